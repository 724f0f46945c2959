"""`gpu-dra up` keeps its cluster running and leaves nothing behind (issue 16, item 6).

A service killed with SIGKILL is restarted (as the kubelet restarts a DaemonSet pod) and the rest keep
going; a second `up` on the same data dir resumes with fresh credentials and the state kept; a signal
during start, or during the teardown of `up` or `demo`, leaves no process and no temporary dir.
Real processes throughout: the test reads the console as it is printed and checks pids in /proc.

A cluster costs seconds to start, so the tests that kill one child and watch it come back share one (each
deletes the pods it made and reads the restart counters as deltas), and one data dir's whole life (an
impatient teardown, a second `up`, a SIGKILL of `up`) is a single test.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import nats
import pytest

from shared.events import catalog
from shared.natsjwt import Creds
from tests.cluster.helpers import Up, metric, metrics_base, pod_manifest
from tests.polling import gone

pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")]

NODE0 = "gpu-node-0"


def checkpoint_claims(data_dir: Path, node: str = NODE0) -> dict:
    path = data_dir / "nodes" / node / "var/lib/kubelet/plugins/gpu.nvidia.com/checkpoint.json"
    return dict(json.loads(path.read_text()).get("preparedClaims") or {})


def claim_uid(up: Up, pod: str) -> str:
    (claim,) = [c for c in up.json("get", "resourceclaims")["items"] if c["metadata"]["name"].startswith(f"{pod}-")]
    return str(claim["metadata"]["uid"])


def leaves_nothing(up: Up, pids: list[int]) -> None:
    assert pids, "the cluster's processes were seen"
    assert gone(pids) == [], f"still running after {up.command} exited: {gone(pids, 0)}"
    assert up.pids() == [] if up.data_dir else True
    assert up.runtime_dirs() == [], "temporary dirs are removed"


@pytest.fixture
def cleanup():
    started: list[Up] = []
    yield started.append
    for up in started:
        up.kill()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory):
    """One `up` (two nodes, a metrics port) for the tests that kill a child and watch it come back."""
    port = metrics_base()
    up = Up(tmp_path_factory.mktemp("supervised") / "cluster", "--metrics-port", str(port))
    try:
        up.wait_ready()
        yield up, port
    finally:
        up.kill()


@pytest.fixture
def shared(shared_cluster: tuple[Up, int]):
    """The shared cluster, still running; the pods a test made are deleted after it."""
    up, port = shared_cluster
    assert up.proc.poll() is None, "the shared cluster stopped:\n" + "".join(up.output)
    yield up, port
    up.kubectl("delete", "pods", "--all", "--wait=true", "--timeout=60s")


def test_a_preparer_killed_with_sigkill_is_restarted_and_prepares_the_next_claim(shared: tuple[Up, int]) -> None:
    up, port = shared
    url = f"http://127.0.0.1:{port}/metrics"
    restarts = metric(url, "gpu_dra_up_process_restarts_total", process=f"{NODE0}-preparer") or 0.0
    other_restarts = metric(url, "gpu_dra_up_process_restarts_total", process="gpu-node-1-preparer")
    pattern = f"shared.cli preparer --node {NODE0} .*{up.data_dir}"
    (old,) = up.pids(pattern)
    others = {pid for pid in up.pids() if pid != old}
    mark = len(up.output)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as resp:
        assert resp.status == 200, "every process runs"

    os.kill(old, signal.SIGKILL)
    restarted = up.wait_line(lambda line: f"{NODE0}-preparer restarted" in line, timeout=30, after=mark)
    exited = up.wait_line(lambda line: f"{NODE0}-preparer (pid {old}) killed by SIGKILL" in line, after=mark)
    assert "restarting in" in exited, exited
    found = re.search(r"\(pid (\d+),", restarted)
    assert found, restarted
    new = int(found[1])
    assert new != old
    # The launcher that sets the parent-death signal execs the preparer in place (same pid): its
    # command line names the preparer once the exec is done.
    assert up.pid_matches(new, pattern), "".join(up.output[mark:])
    assert up.proc.poll() is None, "up keeps going"
    assert others <= set(up.pids()), "no other service was stopped or restarted"
    assert metric(url, "gpu_dra_up_process_restarts_total", process=f"{NODE0}-preparer") == restarts + 1
    assert metric(url, "gpu_dra_up_process_running", process=f"{NODE0}-preparer") == 1.0
    # None on a fresh cluster: the other node's preparer never restarted
    assert metric(url, "gpu_dra_up_process_restarts_total", process="gpu-node-1-preparer") == other_restarts
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
        assert resp.status == 200

    # A new claim on that node is prepared by the restarted preparer.
    up.kubectl("apply", "-f", "-", stdin=pod_manifest("after-restart", node=NODE0))
    up.kubectl("wait", "--for=condition=Ready", "pod/after-restart", "--timeout=60s")
    assert up.data_dir is not None
    assert claim_uid(up, "after-restart") in checkpoint_claims(up.data_dir)


def test_nats_server_killed_is_restarted_on_its_port_with_its_data_and_the_cluster_goes_on(
    shared: tuple[Up, int],
) -> None:
    up, port = shared
    assert up.data_dir is not None
    url = f"http://127.0.0.1:{port}/metrics"
    restarts = metric(url, "gpu_dra_up_process_restarts_total", process="nats-server") or 0.0
    nats_url = re.search(r"nats://\S+", up.wait_line(lambda line: "nats-server (JetStream)" in line))
    assert nats_url
    up.kubectl("apply", "-f", "-", stdin=pod_manifest("before"))
    up.kubectl("wait", "--for=condition=Ready", "pod/before", "--timeout=60s")
    events = asyncio.run(_stream_messages(nats_url[0], up.data_dir))
    (old,) = up.pids(f"nats-server .*{up.data_dir}")
    mark = len(up.output)
    os.kill(old, signal.SIGKILL)
    up.wait_line(lambda line: "nats-server restarted" in line, timeout=30, after=mark)
    assert metric(url, "gpu_dra_up_process_restarts_total", process="nats-server") == restarts + 1
    assert asyncio.run(_stream_messages(nats_url[0], up.data_dir)) >= events, "same port, same JetStream data"
    up.kubectl("delete", "pod", "before", "--wait=true", "--timeout=60s")
    up.kubectl("apply", "-f", "-", stdin=pod_manifest("after"))
    up.kubectl("wait", "--for=condition=Ready", "pod/after", "--timeout=60s")


async def _stream_messages(url: str, data_dir: Path) -> int:
    """Messages in DRA_EVENTS, read as up's own NATS identity (its .creds in the data dir)."""
    jwt_cb, sign_cb = Creds((data_dir / "identities/nats/admin.creds").read_text()).callbacks()
    nc = await nats.connect(url, user_jwt_cb=jwt_cb, signature_cb=sign_cb, inbox_prefix="_INBOX_admin")
    try:
        info = await nc.jetstream().stream_info(catalog.EVENTS_STREAM.name)
        return int(info.state.messages)
    finally:
        await nc.close()


def test_a_data_dir_outlives_an_impatient_teardown_and_a_sigkill_of_up_leaves_no_process(
    tmp_path: Path, cleanup
) -> None:
    """One data dir's life: signals during the teardown of `up` do not cut it short and it leaves nothing; `up`
    again on that dir resumes with fresh credentials and the state kept; `up` killed with SIGKILL takes its
    processes along and the next `up` sweeps its dirs."""
    from embedded.cluster.tempdirs import sweep_orphaned_dirs

    data_dir = tmp_path / "cluster"
    first = Up(data_dir)
    cleanup(first)
    first.wait_ready()
    first.kubectl("apply", "-f", "-", stdin=pod_manifest("kept", node=NODE0))
    first.kubectl("wait", "--for=condition=Ready", "pod/kept", "--timeout=60s")
    uid = claim_uid(first, "kept")
    old_kubeconfig = first.kubeconfig.read_text() if first.kubeconfig else ""
    nats_url = re.search(r"nats://\S+", first.wait_line(lambda line: "nats-server (JetStream)" in line))
    assert nats_url
    events = asyncio.run(_stream_messages(nats_url[0], data_dir))
    assert events > 0, "the prepare was published"
    pids = first.pids()
    first.signal(signal.SIGINT)
    first.wait_line(lambda line: line.startswith("stopping"), timeout=30)
    first.signal(signal.SIGINT)  # impatient Ctrl-C, then SIGTERM, while the services are being stopped
    first.signal(signal.SIGTERM)
    assert first.proc.wait(timeout=60) == 0, "".join(first.output)
    leaves_nothing(first, pids)

    second = Up(data_dir)
    cleanup(second)
    second.wait_ready(timeout=150)  # the stale kubeconfig names a server that is gone: no hang on it
    assert second.kubeconfig is not None and second.kubeconfig.read_text() != old_kubeconfig
    stale = subprocess.run(
        ["kubectl", "--kubeconfig", "/dev/stdin", "get", "nodes"],
        input=old_kubeconfig,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stale.returncode != 0, "the old kubeconfig (its token, its port) no longer gets in"
    pod = second.json("get", "pod", "kept")
    assert pod["metadata"]["uid"] and pod["status"]["phase"] == "Running", "API objects are kept"
    assert claim_uid(second, "kept") == uid
    assert uid in checkpoint_claims(data_dir), "the node's checkpoint is kept"
    nats_url = re.search(r"nats://\S+", second.wait_line(lambda line: "nats-server (JetStream)" in line))
    assert nats_url
    assert asyncio.run(_stream_messages(nats_url[0], data_dir)) >= events, "JetStream data is kept"
    second.kubectl("delete", "pod", "kept", "--wait=true", "--timeout=60s")  # and it is a working cluster
    second.kubectl("apply", "-f", "-", stdin=pod_manifest("next", node=NODE0))
    second.kubectl("wait", "--for=condition=Ready", "pod/next", "--timeout=60s")

    pids = second.pids()
    assert len(pids) >= 8, pids  # nats-server, apiserver, 4 cluster services, discovery, preparer, ...
    runtime = second.runtime_dirs()
    assert runtime, "its short socket dir"
    os.kill(second.proc.pid, signal.SIGKILL)  # up alone: no chance to clean up
    second.proc.wait()
    assert gone(pids) == [], "every child got its parent-death signal"
    left = [p for p in runtime if p.exists()]
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        # Alone, the dir is still there. Under pytest-xdist an `up` of another test may start meanwhile and
        # sweep it first, which is the behaviour checked next.
        assert left, "the short socket dir is still there"
    assert set(left) <= set(sweep_orphaned_dirs())  # what the next `up` does first
    assert not [p for p in runtime if p.exists()]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_start_stops_everything_and_removes_the_temporary_dirs(
    sig: signal.Signals, code: int, cleanup
) -> None:
    up = Up(None)  # no --data-dir: a temporary one, which must go too
    cleanup(up)
    line = up.wait_line(lambda line: "API server" in line)  # services are being started now
    data_dir = Path(re.search(r"kubeconfig (\S+)/kubeconfig\)", line)[1])  # type: ignore[index]
    up.data_dir = data_dir
    pids = up.pids()
    up.signal(sig)
    assert up.proc.wait(timeout=60) == code, "".join(up.output)
    assert "ready:" not in "".join(up.output)
    leaves_nothing(up, pids)
    assert not data_dir.exists()


def test_demo_interrupted_during_teardown_leaves_nothing(tmp_path: Path, cleanup) -> None:
    workloads = tmp_path / "workloads"
    workloads.mkdir()
    # a pod whose log names its GPU at once: the demo's log check passes without waiting out --log-timeout
    shutil.copy(Path(__file__).resolve().parents[2] / "examples" / "workloads" / "full-gpu.yaml", workloads)
    demo = Up(None, "--workloads", str(workloads), nodes=1, command="demo")
    cleanup(demo)
    line = demo.wait_line(lambda line: "API server" in line)
    demo.data_dir = Path(re.search(r"kubeconfig (\S+)/kubeconfig\)", line)[1])  # type: ignore[index]
    demo.wait_line(lambda line: "pods running after" in line)
    pids = demo.pids()
    demo.wait_line(lambda line: "stopping: every service" in line)
    demo.signal(signal.SIGINT)  # the demo is done and tearing down: Ctrl-C, Ctrl-C
    demo.signal(signal.SIGINT)
    assert demo.proc.wait(timeout=60) == 130, "".join(demo.output)
    leaves_nothing(demo, pids)
    assert not demo.data_dir.exists()
