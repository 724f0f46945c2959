"""The real time-slice and MPS code of discovery: simulated GPUs, the driver's binaries from a fake driver
root (tests/fakedriver.py stubs that record every call), requests over a real nats-server."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, Literal

import pytest

from embedded.harness.discovery import RunningDiscovery, running_discovery
from services.discovery import config
from shared.bus import Bus
from shared.events import catalog
from shared.events.devices import MpsStartRequest, MpsStopRequest, SetSharingRequest
from tests.fakedriver import FakeDriver, make_driver_root
from tests.polling import wait_gone

GIB = 1024**3


@pytest.fixture
def fake(tmp_path: Path) -> FakeDriver:
    return make_driver_root(tmp_path / "driver")


def real(bus: Bus, tmp_path: Path, fake: FakeDriver, **overrides: Any):
    """Discovery on two simulated H100s that runs the fake driver root's binaries."""
    return running_discovery(
        bus, "n1", "h100x2", tmp_path / "sim", driver_root=str(fake.root), **{"tool_timeout": 5.0, **overrides}
    )


def bin_path(fake: FakeDriver) -> str:
    return str(fake.root / "usr" / "bin")


async def set_sharing(bus: Bus, uuid: str, timeslice: Literal["Default", "Short", "Medium", "Long"]):
    return await bus.request(
        catalog.DEVICE_SET_SHARING, SetSharingRequest(gpu_uuids=[uuid], timeslice=timeslice), timeout=20, node="n1"
    )


def gpu0(disc: RunningDiscovery):
    return disc.inventory.gpus[0]


async def test_timeslice_runs_nvidia_smi_and_is_read_back_after_a_restart(bus, tmp_path, fake):
    async with real(bus, tmp_path, fake) as disc:
        uuid = gpu0(disc).uuid
        reply = await set_sharing(bus, uuid, "Long")
        assert reply.ok, reply.error
        [call] = fake.calls("nvidia-smi")
        assert call["argv"] == ["compute-policy", "-i", uuid, "--set-timeslice", "3"]
        libc_dir = str(fake.root / fake.lib_dir.lstrip("/"))
        assert libc_dir not in call["env"].get("LD_LIBRARY_PATH", "").split(":"), "a dir with a libc: never"
        assert fake.timeslice(uuid) == "3"
        assert gpu0(disc).sharing.timeslice == "Long" and disc.inventory.gpus[1].sharing.timeslice == "Default"
        record = json.loads((Path(disc.config.state_dir) / "timeslice" / f"{uuid}.json").read_bytes())
        assert record["applied"] == 3 and record["pending"] is None
    # A new process reads the value from its record (the simulated NVML under it still says Default).
    async with real(bus, tmp_path, fake) as disc:
        assert gpu0(disc).sharing.timeslice == "Long"
        assert len(fake.calls("nvidia-smi")) == 1, "a restart sets nothing"


async def test_failed_or_hung_nvidia_smi_is_a_typed_error(bus, tmp_path, fake):
    async with real(bus, tmp_path, fake, tool_timeout=1.0) as disc:
        uuid = gpu0(disc).uuid
        fake.fail("nvidia-smi", "Insufficient Permissions")
        failed = await set_sharing(bus, uuid, "Short")
        assert not failed.ok and failed.error.code == "tool-failed"
        assert "--set-timeslice 1" in failed.error.message and "Insufficient Permissions" in failed.error.message
        # the value was recorded before the call: whatever the GPU holds now, it may be Short
        assert gpu0(disc).sharing.timeslice == "Short"

        fake.heal("nvidia-smi")
        fake.hang("nvidia-smi")
        hung = await set_sharing(bus, uuid, "Medium")
        assert not hung.ok and hung.error.code == "timeout" and "within 1s" in hung.error.message
        assert wait_gone(fake.calls("nvidia-smi")[-1]["pid"]), "a timed-out nvidia-smi is killed"

        fake.heal("nvidia-smi")
        reset = await set_sharing(bus, uuid, "Default")
        assert reset.ok, reset.error
        assert fake.timeslice(uuid) == "0" and gpu0(disc).sharing.timeslice == "Default"


def daemon_pid(pipe_dir: str) -> int:
    return int((Path(pipe_dir) / "nvidia-cuda-mps-control.pid").read_text())


async def start_mps(bus: Bus, daemon_id: str, uuids: list[str], **kw: Any):
    return await bus.request(
        catalog.DEVICE_MPS_START, MpsStartRequest(daemon_id=daemon_id, gpu_uuids=uuids, **kw), timeout=20, node="n1"
    )


async def stop_mps(bus: Bus, daemon_id: str):
    return await bus.request(catalog.DEVICE_MPS_STOP, MpsStopRequest(daemon_id=daemon_id), timeout=20, node="n1")


async def test_mps_daemon_commands_in_order_and_stopped_cleanly(bus, tmp_path, fake):
    async with real(bus, tmp_path, fake) as disc:
        uuids = [g.uuid for g in disc.inventory.gpus]
        started = await start_mps(
            bus,
            "claim-1",
            uuids,
            active_thread_percentage=50,
            pinned_device_memory_limits={uuids[0]: 10 * GIB, uuids[1]: 5 * GIB},
        )
        assert started.ok, started.error
        calls = fake.calls("nvidia-cuda-mps-control")
        assert calls[0]["argv"] == ["-d"]
        assert calls[0]["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(uuids)
        assert calls[0]["env"]["CUDA_MPS_PIPE_DIRECTORY"] == started.pipe_dir
        assert calls[0]["env"]["CUDA_MPS_LOG_DIRECTORY"] == started.log_dir
        limits = sorted([(uuids[0], "10240M"), (uuids[1], "5120M")])
        assert [c["stdin"] for c in calls[1:]] == [
            "set_default_active_thread_percentage 50\n",
            *(f"set_default_device_pinned_mem_limit {u} {m}\n" for u, m in limits),
            "get_default_active_thread_percentage\n",
        ]
        assert all(c["env"]["CUDA_MPS_PIPE_DIRECTORY"] == started.pipe_dir for c in calls[1:])
        pid = daemon_pid(started.pipe_dir)
        record = json.loads((Path(started.pipe_dir).parent / "daemon.json").read_bytes())
        assert record["pid"] == pid and record["state"] == "ready"
        assert {g.sharing.mps_daemon for g in disc.inventory.gpus} == {"claim-1"}
        assert {g.sharing.compute_mode for g in disc.inventory.gpus} == {"ExclusiveProcess"}
        # the same request again is answered from the record: nothing is started twice
        again = await start_mps(bus, "claim-1", uuids, active_thread_percentage=50)
        assert again.ok and again.pipe_dir == started.pipe_dir
        assert len(fake.calls("nvidia-cuda-mps-control")) == len(calls)

        stopped = await stop_mps(bus, "claim-1")
        assert stopped.ok and stopped.stopped
        assert fake.calls("nvidia-cuda-mps-control")[-1]["stdin"] == "quit\n"
        assert wait_gone(pid)
        assert not Path(started.pipe_dir).parent.exists()
        assert {g.sharing.mps_daemon for g in disc.inventory.gpus} == {""}
        assert {g.sharing.compute_mode for g in disc.inventory.gpus} == {"Default"}
        twice = await stop_mps(bus, "claim-1")
        assert twice.ok and not twice.stopped


async def test_one_daemon_serves_many_starts_with_its_settings_and_refuses_others(bus, tmp_path, fake):
    """A GPU's one daemon for its shares: every share's start confirms it; other settings are refused."""
    async with real(bus, tmp_path, fake) as disc:
        uuids = [gpu0(disc).uuid]
        first = await start_mps(bus, "gpu-shared", uuids, pinned_device_memory_limits={uuids[0]: 10 * GIB})
        assert first.ok, first.error
        pid = daemon_pid(first.pipe_dir)
        for _ in range(7):
            again = await start_mps(bus, "gpu-shared", uuids, pinned_device_memory_limits={uuids[0]: 10 * GIB})
            assert again.ok and again.pipe_dir == first.pipe_dir
        assert [c["argv"] for c in fake.calls("nvidia-cuda-mps-control") if c["argv"]] == [["-d"]]
        for kw in ({"active_thread_percentage": 50}, {"pinned_device_memory_limits": {uuids[0]: 5 * GIB}}):
            refused = await start_mps(bus, "gpu-shared", uuids, **kw)
            assert not refused.ok and "other settings" in refused.error.message, kw
        assert gpu0(disc).sharing.mps_daemon == "gpu-shared"
        assert (await stop_mps(bus, "gpu-shared")).stopped
        assert wait_gone(pid, timeout=2.0)


def serving(pipe_dir: str) -> list[int]:
    """Live processes whose environment names `pipe_dir` as their MPS pipe dir (what a leak would be)."""
    needle = f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode()
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (
                needle in (proc / "environ").read_bytes().split(b"\0")
                and (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
            ):
                out.append(int(proc.name))
        except OSError:
            continue
    return out


async def test_mps_start_failure_is_clear_and_leaves_nothing(bus, tmp_path, fake):
    async with real(bus, tmp_path, fake) as disc:
        uuids = [gpu0(disc).uuid]
        fake.fail("nvidia-cuda-mps-control", "MPS is not supported on this GPU")
        reply = await start_mps(bus, "claim-2", uuids)
        assert not reply.ok and reply.error.code == "tool-failed"
        assert "nvidia-cuda-mps-control -d" in reply.error.message
        assert "MPS is not supported on this GPU" in reply.error.message
        assert [c["argv"] for c in fake.calls("nvidia-cuda-mps-control")] == [["-d"]]
        assert not (Path(disc.config.mps_root) / "claim-2").exists()
        assert gpu0(disc).sharing.mps_daemon == "" and gpu0(disc).sharing.compute_mode == "Default"


async def test_a_refused_setting_stops_the_started_daemon(bus, tmp_path, fake):
    async with real(bus, tmp_path, fake) as disc:
        uuids = [gpu0(disc).uuid]
        fake.fail_once("nvidia-cuda-mps-control", "Invalid value", when="set_default_active_thread_percentage")
        reply = await start_mps(bus, "claim-4", uuids, active_thread_percentage=30)
        assert not reply.ok and reply.error.code == "tool-failed"
        assert "set_default_active_thread_percentage 30" in reply.error.message
        assert "Invalid value" in reply.error.message
        calls = fake.calls("nvidia-cuda-mps-control")
        assert [c["argv"] or c["stdin"] for c in calls] == [
            ["-d"],
            "set_default_active_thread_percentage 30\n",
            "quit\n",
        ]
        pipe_dir = calls[0]["env"]["CUDA_MPS_PIPE_DIRECTORY"]
        assert serving(pipe_dir) == [], "the daemon that was started is gone"
        assert not Path(pipe_dir).parent.exists()
        assert gpu0(disc).sharing.mps_daemon == "" and gpu0(disc).sharing.compute_mode == "Default"


async def test_mps_records_after_a_discovery_restart(bus, tmp_path, fake):
    async with real(bus, tmp_path, fake) as disc:
        [a, b] = [g.uuid for g in disc.inventory.gpus]
        alive = await start_mps(bus, "alive", [a])
        dead = await start_mps(bus, "dead", [b])
        assert alive.ok and dead.ok
        alive_pid, dead_pid = daemon_pid(alive.pipe_dir), daemon_pid(dead.pipe_dir)
    os.kill(dead_pid, signal.SIGKILL)  # e.g. discovery's container restarted and took it along
    assert wait_gone(dead_pid)
    async with real(bus, tmp_path, fake) as disc:
        # the gone daemon's record and dirs are cleaned; the live one is still known and served
        assert [g.sharing.mps_daemon for g in disc.inventory.gpus] == ["alive", ""]
        assert not Path(dead.pipe_dir).parent.exists()
        assert disc.inventory.gpus[1].sharing.compute_mode == "Default"
        stopped = await stop_mps(bus, "alive")  # found by its record and pid file after the restart
        assert stopped.ok and stopped.stopped
        assert fake.calls("nvidia-cuda-mps-control")[-1]["stdin"] == "quit\n"
        assert wait_gone(alive_pid)
        assert not Path(alive.pipe_dir).parent.exists()


def test_a_driver_root_under_simulation_selects_the_real_binaries(tmp_path) -> None:
    sim = config.parse(["--node", "n1", "--simulate", "h100x2", "--dev-root", str(tmp_path)])
    assert not sim.runs_driver_tools, "the local cluster: simulated GPUs, no binaries"
    both = config.parse(
        ["--node", "n1", "--simulate", "h100x2", "--dev-root", str(tmp_path), "--driver-root", str(tmp_path / "driver")]
    )
    assert both.runs_driver_tools and both.simulated
    real_node = config.parse(["--node", "n1"])
    assert real_node.runs_driver_tools
    assert real_node.state_dir == "/var/lib/kubelet/plugins/gpu.nvidia.com/discovery"
    with pytest.raises(config.ConfigError, match="--tool-timeout"):
        config.parse(["--node", "n1", "--tool-timeout", "0"])
