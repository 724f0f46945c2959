"""Time-sliced and MPS claims on the real code path: the preparer over its real socket, discovery in-process
on simulated H100s running the binaries of a fake driver root (tests/fakedriver.py), over a real
nats-server. The stubs record every command: the tests check them, their order and the cleanup."""

from __future__ import annotations

from pathlib import Path

from embedded.harness.discovery import RunningDiscovery
from shared.bus import Bus
from tests.fakedriver import FakeDriver
from tests.polling import wait_gone
from tests.preparer.helpers import MemoryClaims, claim_doc, gpu_config, running_node, spec_of, without_metadata


def gpu(disc: RunningDiscovery, name: str):
    return next(g for g in disc.inventory.gpus if g.name == name)


def timeslice_calls(fake: FakeDriver) -> list[tuple[str, str]]:
    """(uuid, value) of every `nvidia-smi compute-policy -i UUID --set-timeslice N`, in order."""
    out = []
    for c in fake.calls("nvidia-smi"):
        argv = c["argv"]
        assert argv[:2] == ["compute-policy", "-i"] and argv[3] == "--set-timeslice", argv
        out.append((argv[2], argv[4]))
    return out


async def test_time_sliced_claim_sets_the_policy_and_unprepare_resets_it(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    uuid = gpu(real_discovery, "gpu-0").uuid
    claim = claims.add(
        claim_doc(
            name="ts",
            results=[("gpu", "gpu-0")],
            configs=[gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})],
        )
    )
    async with running_node(claims, root, bus=bus) as node:
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        assert timeslice_calls(fake) == [(uuid, "3")]
        assert node.service.checkpoint.claims[claim.uid].timesliced_gpus == [uuid]
        assert gpu(real_discovery, "gpu-0").sharing.timeslice == "Long"
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert timeslice_calls(fake) == [(uuid, "3"), (uuid, "0")]
        assert fake.timeslice(uuid) == "0" and gpu(real_discovery, "gpu-0").sharing.timeslice == "Default"


async def test_a_failed_policy_call_fails_the_prepare_and_resets_the_gpu(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    uuid = gpu(real_discovery, "gpu-1").uuid
    claim = claims.add(
        claim_doc(
            name="ts-fail",
            results=[("gpu", "gpu-1")],
            configs=[gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Medium"}})],
        )
    )
    fake.fail_once("nvidia-smi", "Unable to set timeslice: Insufficient Permissions")
    async with running_node(claims, root, bus=bus) as node:
        error = (await node.plugin.prepare([claim]))[claim.uid].error
        assert "Insufficient Permissions" in error and "--set-timeslice 2" in error
        # the GPU was recorded before the call, so the rollback reset it although the call failed
        assert timeslice_calls(fake) == [(uuid, "2"), (uuid, "0")]
        assert claim.uid not in node.service.checkpoint.claims
        assert gpu(real_discovery, "gpu-1").sharing.timeslice == "Default"


async def test_mps_claim_runs_a_daemon_that_unprepare_stops(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    uuids = sorted([gpu(real_discovery, "gpu-1").uuid, gpu(real_discovery, "gpu-2").uuid])
    claim = claims.add(
        claim_doc(
            name="mps",
            results=[("gpus", "gpu-1"), ("gpus", "gpu-2")],
            configs=[
                gpu_config(
                    {
                        "strategy": "MPS",
                        "mpsConfig": {
                            "defaultActiveThreadPercentage": 50,
                            "defaultPinnedDeviceMemoryLimit": "10Gi",
                            "defaultPerDevicePinnedMemoryLimit": {"1": "5Gi"},
                        },
                    }
                )
            ],
        )
    )
    async with running_node(claims, root, bus=bus) as node:
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        daemon = node.service.checkpoint.claims[claim.uid].mps_daemon_id
        calls = fake.calls("nvidia-cuda-mps-control")
        assert [c["argv"] or c["stdin"] for c in calls] == [
            ["-d"],
            "set_default_active_thread_percentage 50\n",
            f"set_default_device_pinned_mem_limit {uuids[0]} 10240M\n",
            f"set_default_device_pinned_mem_limit {uuids[1]} 5120M\n",
            "get_default_active_thread_percentage\n",
        ]
        env = calls[0]["env"]
        pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(uuids) and pipe.parent.name == daemon
        assert Path(env["CUDA_MPS_LOG_DIRECTORY"]) == pipe.parent / "log"
        pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
        for dev in spec_of(root / "cdi", claim.uid)["devices"]:
            mounts = {m["containerPath"]: m["hostPath"] for m in without_metadata(dev["containerEdits"])["mounts"]}
            assert mounts == {"/tmp/nvidia-mps": str(pipe), "/dev/shm": str(pipe.parent / "shm")}
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert fake.calls("nvidia-cuda-mps-control")[-1]["stdin"] == "quit\n"
        assert wait_gone(pid), "the daemon is stopped on unprepare"
        assert not pipe.parent.exists()
        assert gpu(real_discovery, "gpu-1").sharing.mps_daemon == ""


async def test_mps_daemon_that_cannot_start_fails_the_prepare_and_leaves_nothing(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    claim = claims.add(
        claim_doc(name="mps-fail", results=[("gpu", "gpu-3")], configs=[gpu_config({"strategy": "MPS"})])
    )
    fake.fail("nvidia-cuda-mps-control", "An instance of this daemon is already running")
    async with running_node(claims, root, bus=bus) as node:
        error = (await node.plugin.prepare([claim]))[claim.uid].error
        assert "nvidia-cuda-mps-control -d" in error and "already running" in error
        assert claim.uid not in node.service.checkpoint.claims
        assert node.cdi_files() == []
        assert [c["argv"] for c in fake.calls("nvidia-cuda-mps-control")] == [["-d"]]
        assert list(Path(real_discovery.config.mps_root).iterdir()) == []
        assert gpu(real_discovery, "gpu-3").sharing.compute_mode == "Default"
