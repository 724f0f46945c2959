"""`gpu-dra up` as a user meets it: a subprocess, kubectl against it, Ctrl-C, nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")]

POD = """\
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: one-gpu, namespace: default}}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {{deviceClassName: gpu.nvidia.com{selector}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  containers:
  - name: ctr
    image: ubuntu:22.04
    resources: {{claims: [{{name: gpu}}]}}
  resourceClaims:
  - {{name: gpu, resourceClaimTemplateName: {template}}}
"""


def pod_manifest(name: str, template: str = "one-gpu", selector: str = "") -> str:
    text = POD.format(name=name, template=template, selector=selector)
    if template != "one-gpu":
        text = text.replace("name: one-gpu,", f"name: {template},")
    return text


class Up:
    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.kubeconfig = data_dir / "kubeconfig"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "up", "--nodes", "2", "--gpus", "h100x1", "--data-dir",
             str(data_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.output: list[str] = []

    def wait_ready(self, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("ready:"):
                return
            assert time.monotonic() < deadline, "".join(self.output)
        raise AssertionError("gpu-dra up exited before ready:\n" + "".join(self.output))

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        done = subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args], input=stdin,
                              capture_output=True, text=True, timeout=60)
        if check:
            assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def json(self, *args: str) -> dict:
        return dict(json.loads(self.kubectl(*args, "-o", "json")))


@pytest.fixture
def up(tmp_path: Path):
    cluster = Up(tmp_path / "cluster")
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        if cluster.proc.poll() is None:
            os.killpg(cluster.proc.pid, signal.SIGKILL)
            cluster.proc.wait()


def test_kubectl_sees_the_cluster_and_pods_get_and_free_gpus_and_ctrl_c_leaves_nothing(up: Up) -> None:
    nodes = up.json("get", "nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == ["gpu-node-0", "gpu-node-1"]
    assert all(any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
               for n in nodes)
    slices = up.json("get", "resourceslices")["items"]
    assert {s["spec"]["nodeName"] for s in slices if s["spec"]["driver"] == "gpu.nvidia.com"} == \
        {"gpu-node-0", "gpu-node-1"}

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

    # A selector that matches nothing: Pending, with an explanation on the pod and from `gpu-dra explain`.
    up.kubectl("apply", "-f", "-", stdin=pod_manifest(
        "never", template="no-such-gpu", selector=", selectors: [{cel: {expression: \"device.attributes['gpu.nvidia.com'].productName == 'No Such GPU'\"}}]"))
    up.kubectl("wait", "--for=condition=PodScheduled=false", "pod/never", "--timeout=60s")
    pod = up.json("get", "pod", "never")
    (cond,) = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert cond["reason"] == "Unschedulable" and "gpu" in cond["message"], cond
    explained = subprocess.run([sys.executable, "-m", "shared.cli", "explain", "pod", "default/never",
                                "--kubeconfig", str(up.kubeconfig)], capture_output=True, text=True, timeout=60)
    assert explained.returncode == 0, explained.stderr
    assert "gpu-node-0" in explained.stdout and "selector" in explained.stdout, explained.stdout

    # Ctrl-C: everything stops, no process and no socket left behind.
    os.killpg(up.proc.pid, signal.SIGINT)
    assert up.proc.wait(timeout=60) == 0, "".join(up.output) + (up.proc.stdout.read() if up.proc.stdout else "")
    leftovers = subprocess.run(["pgrep", "-f", str(up.data_dir)], capture_output=True, text=True).stdout.split()
    assert leftovers == [], leftovers
    sockets = [p for p in up.data_dir.rglob("*.sock")] if up.data_dir.exists() else []
    assert sockets == [], sockets
    kubelet_dirs = [n / "var/lib/kubelet" for n in (up.data_dir / "nodes").iterdir()]  # links to short socket dirs
    assert all(d.is_symlink() and not d.exists() for d in kubelet_dirs), "the socket dirs are removed"
