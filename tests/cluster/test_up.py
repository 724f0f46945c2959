"""`gpu-dra up` as a user meets it: a subprocess, kubectl against it, Ctrl-C, nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.helpers import Up, pod_manifest

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")]


@pytest.fixture
def up(tmp_path: Path):
    cluster = Up(tmp_path / "cluster")
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.kill()


def test_kubectl_sees_the_cluster_and_pods_get_and_free_gpus_and_ctrl_c_leaves_nothing(up: Up) -> None:
    nodes = up.json("get", "nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == ["gpu-node-0", "gpu-node-1"]
    assert all(any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"]) for n in nodes)
    slices = up.json("get", "resourceslices")["items"]
    assert {s["spec"]["nodeName"] for s in slices if s["spec"]["driver"] == "gpu.nvidia.com"} == {
        "gpu-node-0",
        "gpu-node-1",
    }

    # Two GPUs in the cluster: two pods run, a third waits until one is deleted.
    for name in ("a", "b"):
        up.kubectl("apply", "-f", "-", stdin=pod_manifest(name))
    up.kubectl("wait", "--for=condition=Ready", "pod/a", "pod/b", "--timeout=60s")
    up.kubectl("apply", "-f", "-", stdin=pod_manifest("c"))
    up.kubectl("wait", "--for=condition=PodScheduled=false", "pod/c", "--timeout=60s")
    claims = up.json("get", "resourceclaims")["items"]
    assert len(claims) == 3 and sum(1 for c in claims if (c.get("status") or {}).get("allocation")) == 2
    table = {line.split()[0]: line.split()[2] for line in up.kubectl("get", "pods").splitlines()[1:]}
    assert table == {"a": "Running", "b": "Running", "c": "Pending"}, table
    up.kubectl("delete", "pod", "a", "--wait=true", "--timeout=60s")
    up.kubectl("wait", "--for=condition=Ready", "pod/c", "--timeout=60s")

    # `gpu-dra events tail` with what up printed (no flags): pod a's claim prepared, then unprepared.
    exports = up.wait_line(lambda line: "export GPU_DRA_NATS_URL=" in line).split("#")[0].split()[1:]
    env = {**os.environ, **dict(item.split("=", 1) for item in exports)}
    claim_a = next(c["metadata"]["uid"] for c in claims if c["metadata"]["name"].startswith("a-"))
    tailed = subprocess.run(
        [
            sys.executable,
            "-m",
            "shared.cli",
            "events",
            "tail",
            "--since",
            "10m",
            "--type",
            "unprepared",
            "--count",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert tailed.returncode == 0 and "unprepared default/a-" in tailed.stdout, tailed.stdout + tailed.stderr
    tailed = subprocess.run(
        [
            sys.executable,
            "-m",
            "shared.cli",
            "events",
            "tail",
            "--since",
            "10m",
            "--namespace",
            "default",
            "--type",
            "prepared",
            "--count",
            "3",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert tailed.returncode == 0, tailed.stderr
    prepared = [json.loads(line)["data"] for line in tailed.stdout.splitlines()]
    assert claim_a in {p["claim_uid"] for p in prepared} and {p["event"] for p in prepared} == {"prepared"}
    # ... and an operator's XID injection reaches the node with the same credential (XID 13, an application
    # error, taints nothing)
    injected = subprocess.run(
        [
            sys.executable,
            "-m",
            "shared.cli",
            "discovery",
            "inject-xid",
            "--node",
            "gpu-node-0",
            "--device",
            "gpu-0",
            "--xid",
            "13",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert injected.returncode == 0 and "injected on gpu-node-0/gpu-0" in injected.stdout, injected.stderr

    # A selector that matches nothing: Pending, with an explanation on the pod and from `gpu-dra explain`.
    up.kubectl(
        "apply",
        "-f",
        "-",
        stdin=pod_manifest(
            "never",
            template="no-such-gpu",
            selector=(
                ", selectors: [{cel: {expression: "
                "\"device.attributes['gpu.nvidia.com'].productName == 'No Such GPU'\"}}]"
            ),
        ),
    )
    up.kubectl("wait", "--for=condition=PodScheduled=false", "pod/never", "--timeout=60s")
    pod = up.json("get", "pod", "never")
    (cond,) = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert cond["reason"] == "Unschedulable" and "gpu" in cond["message"], cond
    explained = subprocess.run(
        [sys.executable, "-m", "shared.cli", "explain", "pod", "default/never", "--kubeconfig", str(up.kubeconfig)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert explained.returncode == 0, explained.stderr
    assert "gpu-node-0" in explained.stdout and "selector" in explained.stdout, explained.stdout

    # Ctrl-C: everything stops, no process and no socket left behind.
    os.killpg(up.proc.pid, signal.SIGINT)
    assert up.proc.wait(timeout=60) == 0, "".join(up.output)
    leftovers = subprocess.run(["pgrep", "-f", str(up.data_dir)], capture_output=True, text=True).stdout.split()
    assert leftovers == [], leftovers
    assert up.data_dir is not None
    sockets = [p for p in up.data_dir.rglob("*.sock")] if up.data_dir.exists() else []
    assert sockets == [], sockets
    assert up.runtime_dirs() == [], "the short socket dirs are removed"
    checkpoints = list((up.data_dir / "nodes").glob("*/var/lib/kubelet/plugins/gpu.nvidia.com/checkpoint.json"))
    assert len(checkpoints) == 2, "the kubelet state stays in the data dir"
