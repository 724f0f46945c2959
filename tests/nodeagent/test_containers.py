"""The sandboxed container runtime: real bubblewrap processes, their logs, exits, restarts and termination, and
the nvidia-smi shim answering from a simulated NVML state for exactly the devices a container was given."""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from embedded.nodeagent import nvidiasmi
from embedded.nodeagent.containers import PodWorker
from services.discovery import devtree
from services.discovery.simnvml.state import SimCi, SimGi, SimGpu, SimMps, SimState
from tests.polling import eventually

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (make setup)"),
]

H100 = "GPU-11111111-0000-0000-0000-000000000000"
A100 = "GPU-22222222-0000-0000-0000-000000000000"
MIG_A = "MIG-aaaaaaaa-0000-0000-0000-000000000000"
MIG_B = "MIG-bbbbbbbb-0000-0000-0000-000000000000"


def sim_state() -> SimState:
    return SimState(
        node="n1",
        machine="x",
        driver_version="550.54.15",
        cuda_version=12040,
        gpus=[
            SimGpu(
                index=0,
                profile="h100",
                uuid=H100,
                minor=0,
                bus_id="0000:1a:00.0",
                pcie_root="pci0000:00",
                numa_node=0,
                compute_mode=3,
                timeslice=2,
            ),
            SimGpu(
                index=1,
                profile="a100-40gb",
                uuid=A100,
                minor=1,
                bus_id="0000:2a:00.0",
                pcie_root="pci0000:00",
                numa_node=0,
                mig_enabled=True,
                gis=[
                    SimGi(id=1, profile_index=1, start=0, size=2, cis=[SimCi(id=0, profile_index=1, uuid=MIG_A)]),
                    SimGi(id=2, profile_index=0, start=2, size=1, cis=[SimCi(id=0, profile_index=0, uuid=MIG_B)]),
                ],
            ),
        ],
        mps={
            "d1": SimMps(
                daemon_id="d1", gpu_uuids=[H100], active_thread_percentage=50, pipe_dir="/p", shm_dir="/s", log_dir="/l"
            )
        },
    )


@pytest.fixture
def node(tmp_path: Path) -> dict[str, Path]:
    state = tmp_path / "simnvml.json"
    state.write_bytes(msgspec.json.encode(sim_state()))
    shim = tmp_path / "bin"
    nvidiasmi.install(shim)
    return {"state": state, "shim": shim, "work": tmp_path / "pods", "logs": tmp_path / "logs"}


def pod(name: str, containers: list[dict[str, Any]], policy: str = "Never", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {"containers": containers, "restartPolicy": policy, **spec},
    }


def worker(
    node: dict[str, Path],
    p: dict[str, Any],
    edits: dict[str, Any] | None = None,
    seen: list[dict[str, Any]] | None = None,
    on_change: Callable[[PodWorker], None] | None = None,
) -> PodWorker:
    def changed(w: PodWorker) -> None:
        if seen is not None:
            seen.append(w.status())
        if on_change is not None:
            on_change(w)

    return PodWorker(
        p,
        edits or {},
        bwrap=shutil.which("bwrap") or "",
        work_root=node["work"],
        log_root=node["logs"],
        shim_dir=node["shim"],
        sim_state=str(node["state"]),
        on_change=changed,
        backoff_base=0.3,
    )


def log_of(node: dict[str, Path], p: dict[str, Any], container: str, run: int = 0) -> str:
    meta = p["metadata"]
    path = node["logs"] / f"ns_{meta['name']}_{meta['uid']}" / container / f"{run}.log"
    return "".join(line.partition(" ")[2] + "\n" for line in path.read_text().splitlines())


until = functools.partial(eventually, timeout=20.0, every=0.05)


def gpu_edits(*nodes: str) -> dict[str, Any]:
    return {"ctr": {"env": ["NVIDIA_VISIBLE_DEVICES=void", "EXTRA=from-cdi"], "deviceNodes": list(nodes)}}


async def test_container_prints_its_gpu_env_and_exits(node: dict[str, Path]) -> None:
    p = pod(
        "one",
        [
            {
                "name": "ctr",
                "image": "ubuntu:22.04",
                "command": ["bash", "-c"],
                "args": ["nvidia-smi -L; env | grep -E '^(CUDA|NVIDIA|EXTRA|GREETING)' | sort; id -u"],
                "env": [{"name": "GREETING", "value": "hi"}],
            }
        ],
    )
    w = worker(node, p, gpu_edits("/dev/nvidia0", "/dev/nvidiactl"))
    w.start()
    await w.task  # type: ignore[misc]
    assert w.phase == "Succeeded"
    term = w.status()["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (0, "Completed")
    assert log_of(node, p, "ctr").splitlines() == [
        f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {H100})",
        f"CUDA_VISIBLE_DEVICES={H100}",
        "EXTRA=from-cdi",
        "GREETING=hi",
        "NVIDIA_VISIBLE_DEVICES=void",
        "65534",
    ]


async def test_shim_shows_only_the_visible_mig_device_and_sharing() -> None:
    state = msgspec.to_builtins(sim_state())
    cap = devtree.mig_cap_minors(1, 2, 0)[1]
    env = {nvidiasmi.STATE_ENV: "", nvidiasmi.NODES_ENV: f"/dev/nvidia1:/dev/nvidia-caps/nvidia-cap{cap}"}
    devices = nvidiasmi.visible_devices(state, env[nvidiasmi.NODES_ENV].split(":"))
    assert nvidiasmi.list_lines(devices) == [
        f"GPU 0: NVIDIA A100-SXM4-40GB (UUID: {A100})",
        f"  MIG 1g.5gb       Device  0: (UUID: {MIG_B})",
    ]
    assert nvidiasmi.visible_uuids(devices) == [MIG_B]
    assert nvidiasmi.query(state, devices, ["name", "uuid", "memory.total", "index"], {"csv"}) == [
        "name, uuid, memory.total [MiB], index",
        f"NVIDIA A100-SXM4-40GB, {A100}, 40960 MiB, 0",
    ]
    full = nvidiasmi.visible_devices(state, ["/dev/nvidia0"])
    table = "\n".join(nvidiasmi.table(state, full))
    assert "Exclusive_Process" in table and "Time Slice Interval                   : Medium" in table
    assert "MPS Server                            : Running (daemon d1, active thread percentage 50)" in table
    assert nvidiasmi.run(["--query-gpu=bogus", "--format=csv"], {nvidiasmi.STATE_ENV: "/nonexistent"})[0] == 9


async def test_hostile_commands_fail_inside_and_harm_nothing(node: dict[str, Path]) -> None:
    sentinel = Path(__file__).parent / f".sentinel-{os.getpid()}"
    sentinel.mkdir()
    (sentinel / "keep").write_text("kept")
    try:
        script = (
            f"rm -rf {sentinel} /etc/hostname /usr/bin/env 2>&1 | head -3; echo pwned > /etc/pwned; "
            "timeout 3 rm -rf --no-preserve-root / 2>/dev/null; "
            "apt-get install -y -q cowsay >/dev/null 2>&1; echo apt=$?; "
            "getent hosts example.com || echo no-network; echo ok > /tmp/mine && cat /tmp/mine; exit 3"
        )
        p = pod(
            "evil", [{"name": "ctr", "image": "x", "command": ["bash", "-c", script]}], securityContext={"runAsUser": 0}
        )
        w = worker(node, p)
        w.start()
        await w.task  # type: ignore[misc]
        out = log_of(node, p, "ctr")
        assert w.phase == "Failed" and w.status()["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
        assert "Read-only file system" in out and "apt=100" in out and "no-network" in out and "ok" in out, out
        assert (sentinel / "keep").read_text() == "kept"
        assert not Path("/etc/pwned").exists() and Path("/usr/bin/env").exists()
    finally:
        shutil.rmtree(sentinel)


async def test_crash_loop_backs_off_and_runs_again(node: dict[str, Path]) -> None:
    marker = "/run/pod/ran"  # the work dir survives restarts: the second run succeeds and stays up
    script = (
        # the trap is set before "second" is printed: the test's SIGTERM comes once it reads that line
        f"if [ -e {marker} ]; then trap 'echo bye; exit 0' TERM; echo second; sleep 30 & wait; "
        f"else touch {marker}; echo first; exit 1; fi"
    )
    p = pod("crash", [{"name": "ctr", "image": "x", "command": ["sh", "-c", script]}], policy="Always")
    seen: list[dict[str, Any]] = []
    w = worker(node, p, seen=seen)
    w.start()
    await until(
        lambda: (
            w.status()["containerStatuses"][0]["restartCount"] == 1
            and w.status()["containerStatuses"][0]["state"]["running"] is not None
        )
    )
    reasons = [(s["containerStatuses"][0]["state"].get("waiting") or {}).get("reason") for s in seen]
    assert "CrashLoopBackOff" in reasons
    status = w.status()
    assert status["phase"] == "Running" and status["conditions"][3]["status"] == "True", status
    assert status["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 1
    await until(lambda: "second" in log_of(node, p, "ctr", 1))
    assert log_of(node, p, "ctr", 0) == "first\n"
    started = time.monotonic()
    await w.stop(10.0)
    assert time.monotonic() - started < 5, "SIGTERM ended it (no wait for the grace period)"
    assert "bye" in log_of(node, p, "ctr", 1)


async def test_init_containers_run_in_order_and_sigkill_after_grace(node: dict[str, Path]) -> None:
    p = pod(
        "init",
        [{"name": "ctr", "image": "x", "command": ["sh", "-c", "cd && pwd; trap '' TERM; echo up; sleep 60"]}],
        initContainers=[
            {"name": "a", "image": "x", "command": ["sh", "-c", "echo a"]},
            {"name": "b", "image": "x", "command": ["sh", "-c", "echo b"]},
        ],
    )
    w = worker(node, p)
    w.start()
    await until(
        lambda: (
            w.phase == "Running"
            and (node["logs"] / "ns_init_uid-init" / "ctr" / "0.log").exists()
            and "up" in log_of(node, p, "ctr")
        )
    )
    assert [log_of(node, p, c) for c in ("a", "b")] == ["a\n", "b\n"]
    assert all(c["state"]["terminated"]["reason"] == "Completed" for c in w.status()["initContainerStatuses"])
    started = time.monotonic()
    await w.stop(1.0)
    assert 0.9 < time.monotonic() - started < 5, "TERM ignored: killed once the grace period was over"


async def test_container_without_command_idles_until_stopped(node: dict[str, Path]) -> None:
    p = pod("idle", [{"name": "ctr", "image": "nginx"}], policy="Always")
    w = worker(node, p)
    w.start()
    await until(lambda: w.status()["conditions"][3]["status"] == "True")
    started = time.monotonic()
    await w.stop(10.0)
    assert time.monotonic() - started < 5, "SIGTERM stops it (no wait for the grace period)"
    # 0 once its TERM trap is set, 143 (128 + SIGTERM) when stopped before the shell got that far
    assert w.status()["containerStatuses"][0]["state"]["terminated"]["exitCode"] in (0, 143)


async def test_login_shell_finds_nvidia_smi_where_cdi_puts_it_and_usr_bin_stays_read_only(
    node: dict[str, Path],
) -> None:
    """NVIDIA's pods-shared-gpu spec runs `bash -lc "nvidia-smi -L"`: a login shell resets PATH."""
    p = pod(
        "login",
        [
            {
                "name": "ctr",
                "image": "ubuntu:22.04",
                "command": ["bash", "-lc"],
                "args": [
                    "command -v nvidia-smi; nvidia-smi -L; touch /usr/bin/x 2>/dev/null || echo ro; ls /usr/bin/env"
                ],
            }
        ],
    )
    w = worker(node, p, gpu_edits("/dev/nvidia0"))
    w.start()
    await w.task  # type: ignore[misc]
    assert log_of(node, p, "ctr").splitlines() == [
        "/usr/bin/nvidia-smi",
        f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {H100})",
        "ro",
        "/usr/bin/env",
    ]
    assert w.phase == "Succeeded"


RUN_FROM_CHECKOUT = """
import shutil, subprocess, sys
from pathlib import Path
from embedded.nodeagent import nvidiasmi
from embedded.nodeagent.sandbox import bwrap_argv
root = Path(sys.argv[1])
shim = nvidiasmi.install(root / "bin")
assert str(root) not in shim.read_text(), shim.read_text()
for d in ("tmp", "work"):
    (root / d).mkdir()
argv = bwrap_argv(shutil.which("bwrap"), ["bash", "-lc", "nvidia-smi -L"], work=root / "work", tmp=root / "tmp",
                  shim_dir=root / "bin", uid=65534, sim_state=sys.argv[2],
                  env={nvidiasmi.STATE_ENV: "/run/gpu-dra/simnvml.json", nvidiasmi.NODES_ENV: "/dev/nvidia0"})
done = subprocess.run(argv, capture_output=True, text=True)
print(done.stdout + done.stderr, end="")
sys.exit(done.returncode)
"""


async def test_the_shim_runs_from_a_checkout_under_tmp_which_the_sandbox_hides(
    node: dict[str, Path], tmp_path: Path
) -> None:
    """A checkout under /tmp (the sandbox's /tmp is its own): the shim names only the paths it is mounted at."""
    repo = Path(__file__).resolve().parents[2]
    checkout = tmp_path / "checkout"
    for package in ("shared", "services", "embedded"):
        shutil.copytree(repo / package, checkout / package, ignore=shutil.ignore_patterns("__pycache__"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        RUN_FROM_CHECKOUT,
        str(tmp_path / "run"),
        str(node["state"]),
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(checkout)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    assert (proc.returncode, out.decode()) == (0, f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {H100})\n"), out.decode()


async def just_spawned(node: dict[str, Path], name: str) -> PodWorker:
    """An idle container's worker, returned the moment its sandbox process is spawned (an event, no poll)."""
    spawned = asyncio.Event()

    def note(w: PodWorker) -> None:
        if w.running_pid("ctr"):
            spawned.set()

    w = worker(node, pod(name, [{"name": "ctr", "image": "nginx"}], policy="Always"), on_change=note)
    w.start()
    await spawned.wait()
    return w


async def test_a_pod_stopped_as_its_sandbox_starts_leaves_no_process_behind(node: dict[str, Path]) -> None:
    """Deleted with no grace the moment it starts (`terminationGracePeriodSeconds: 0`): bwrap is killed before
    its child armed `--die-with-parent`, and that child, reparented, held the container's output open, so the
    stop waited for ever and the kubelet never unprepared the pod's claims. Now whoever holds it is killed."""
    for i in range(8):
        w = await just_spawned(node, f"gone-{i}")
        await asyncio.wait_for(w.stop(0.0), 10)
        work = str(node["work"] / f"uid-gone-{i}")
        left = [d for d in os.listdir("/proc") if d.isdigit() and work.encode() in _cmdline(int(d))]
        assert left == [], f"run {i}: sandbox processes outlived the stop: {left}"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


async def test_a_pod_stopped_gracefully_as_its_sandbox_starts_gets_its_sigterm(node: dict[str, Path]) -> None:
    """Deleted the moment it starts, with a grace period: the sandbox has no command yet when the stop comes, and
    the SIGTERM, once sent to nobody, left the container to be killed when the grace period was over. The
    command gets its SIGTERM once it runs, and the idle container's trap ends it at once."""
    w = await just_spawned(node, "soon")
    started = time.monotonic()
    await w.stop(30.0)
    assert time.monotonic() - started < 10, "SIGTERM reached the command (no wait for the grace period)"
    assert w.status()["containerStatuses"][0]["state"]["terminated"]["exitCode"] in (0, 143)
