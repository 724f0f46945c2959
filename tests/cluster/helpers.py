"""A whole local cluster for tests (real processes, real sockets), and ways to look at what pods got."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, watch

from embedded.cluster.apply import Applier
from embedded.nodeagent.podclaims import EDITS_ANNOTATION
from shared.ports import port_is_free


def mig_machine(h100: int, a100: int) -> str:
    """A machine file: `h100` full H100s and `a100` A100-40GB in MIG mode, each cut as one gpu-test4 pod
    needs (2x 1g.5gb, 2g.10gb and 3g.20gb on one parent; 8 memory slices)."""
    return f"""\
gpus:
- profile: h100
  count: {h100}
- profile: a100-40gb
  count: {a100}
  mig_enabled: true
  mig_devices:
  - {{profile: 2g.10gb, placement: 0}}
  - {{profile: 1g.5gb, placement: 2}}
  - {{profile: 1g.5gb, placement: 3}}
  - {{profile: 3g.20gb, placement: 4}}
"""


MIG_MACHINE = mig_machine(h100=4, a100=2)  # every node of the workload tests


def metrics_base() -> int:
    """A `--metrics-port` BASE below Linux's ephemeral range (32768 and up by default), where no connection
    takes its local port: `up` gives each service the next free port after BASE, and a port in the ephemeral
    range could be taken by a connection between that check and the service's bind. Free now, as are the
    next 64 (a cluster's services), or another is tried."""
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(20000, 32768 - 65)
        if all(port_is_free(port) for port in range(base, base + 65)):
            return base
    raise AssertionError("no free block of 65 ports in 20000-32767")


async def pods_in(api: client.ApiClient, namespace: str) -> list[dict[str, Any]]:
    listed = await client.CoreV1Api(api).list_namespaced_pod(namespace)
    return list(api.sanitize_for_serialization(listed).get("items") or [])


def running(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )


async def wait_pods(
    api: client.ApiClient, namespace: str, count: int, ready: bool = True, timeout: float = 60.0
) -> list[dict[str, Any]]:
    """The namespace's pods once `count` exist and (with `ready`) all run; woken by the pod watch."""
    deadline = time.monotonic() + timeout
    pods: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        pods = await pods_in(api, namespace)
        if len(pods) == count and (not ready or all(running(p) for p in pods)):
            return pods
        w = watch.Watch()
        async with w:
            left = max(1, int(deadline - time.monotonic()))
            async for _ in w.stream(client.CoreV1Api(api).list_namespaced_pod, namespace, timeout_seconds=min(left, 5)):
                break
    states = {
        p["metadata"]["name"]: (
            (p.get("status") or {}).get("phase"),
            [c.get("message") for c in (p.get("status") or {}).get("conditions") or [] if c.get("message")],
        )
        for p in pods
    }
    raise AssertionError(f"{namespace}: wanted {count} pods{' running' if ready else ''}; have {states}")


def edits(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """container -> {devices, env, deviceNodes, mounts, cdiDevices} as the kubelet emulator recorded it."""
    return dict(json.loads((pod["metadata"].get("annotations") or {}).get(EDITS_ANNOTATION, "{}")))


async def device_attributes(api: client.ApiClient) -> dict[str, dict[str, Any]]:
    """'pool/device' -> {attribute: value} from every published GPU ResourceSlice."""
    listed = await client.CustomObjectsApi(api).list_cluster_custom_object("resource.k8s.io", "v1", "resourceslices")
    out: dict[str, dict[str, Any]] = {}
    for s in listed.get("items") or []:
        for d in s["spec"].get("devices") or []:
            attrs = {k: next(iter(v.values())) for k, v in (d.get("attributes") or {}).items()}
            out[f"{s['spec']['pool']['name']}/{d['name']}"] = attrs
    return out


async def apply(api: client.ApiClient, path: Path) -> list[dict[str, Any]]:
    return await Applier(api).apply_file(path)


def checkpoint_text(node_dir: Path) -> str:
    path = node_dir / "var/lib/kubelet/plugins/gpu.nvidia.com/checkpoint.json"
    return path.read_text() if path.exists() else ""


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


def pod_manifest(name: str, template: str = "one-gpu", selector: str = "", node: str = "") -> str:
    text = POD.format(name=name, template=template, selector=selector)
    if template != "one-gpu":
        text = text.replace("name: one-gpu,", f"name: {template},")
    if node:
        text = text.replace(
            "spec:\n  containers:", f"spec:\n  nodeSelector: {{kubernetes.io/hostname: {node}}}\n  containers:"
        )
    return text


GPU_POD = """\
apiVersion: v1
kind: Namespace
metadata: {{name: {ns}}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: one-gpu, namespace: {ns}}}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {{deviceClassName: gpu.nvidia.com}}
---
apiVersion: v1
kind: Pod
metadata: {{name: {pod}, namespace: {ns}}}
spec:
  containers:
  - name: {container}
    image: ubuntu:24.04
    command: [sleep, "600"]
    resources: {{claims: [{{name: gpus, request: gpu}}]}}
  - name: {sidecar}
    image: ubuntu:24.04
    command: [sleep, "600"]
  resourceClaims:
  - {{name: gpus, resourceClaimTemplateName: one-gpu}}
"""


def gpu_pod_manifest(namespace: str, pod: str, container: str = "ctr", sidecar: str = "side") -> str:
    """A namespace, its ResourceClaimTemplate `one-gpu` and a sleeping pod whose `container` uses the GPU (claim
    reference `gpus`, request `gpu`) beside a `sidecar` that uses none."""
    return GPU_POD.format(ns=namespace, pod=pod, container=container, sidecar=sidecar)


async def inject_xid(env: dict[str, str], node: str, device: str, xid: int) -> None:
    """`gpu-dra discovery inject-xid` as an operator runs it, with the cluster's NATS settings (`env`)."""
    injected = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        "discovery",
        "inject-xid",
        "--node",
        node,
        "--device",
        device,
        "--xid",
        str(xid),
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await injected.communicate()
    assert injected.returncode == 0, (out + err).decode()


class Up:
    """`gpu-dra up` as a user runs it: a subprocess in its own session, its console read as it comes."""

    def __init__(
        self,
        data_dir: Path | None,
        *args: str,
        nodes: int | None = 2,
        command: str = "up",
        env: dict[str, str] | None = None,
    ):
        """`nodes` None: no --nodes and --gpus flags (the environment may set them)."""
        self.data_dir = data_dir
        self.command = command
        self.kubeconfig = data_dir / "kubeconfig" if data_dir else None
        shape = ["--nodes", str(nodes), "--gpus", "h100x1"] if nodes is not None else []
        argv = [sys.executable, "-m", "shared.cli", command, *shape, *args]
        if data_dir is not None:
            argv += ["--data-dir", str(data_dir)]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.output: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.output.append(line)
                self._changed.notify_all()
        with self._changed:
            self.output.append("")  # EOF
            self._changed.notify_all()

    def wait_line(self, match: Callable[[str], bool], timeout: float = 150, after: int = 0) -> str:
        """The first console line (from index `after`) that `match`es, as soon as it is printed."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.output[after:]:
                    if line and match(line):
                        return line
                if self.output and self.output[-1] == "":
                    raise AssertionError(
                        f"{self.command} exited ({self.proc.wait()}) before the line came:\n" + "".join(self.output)
                    )
                left = deadline - time.monotonic()
                assert left > 0, "no such line in time:\n" + "".join(self.output)
                self._changed.wait(left)

    def wait_ready(self, timeout: float = 150) -> None:
        self.wait_line(lambda line: line.startswith("ready:"), timeout)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        done = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check:
            assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def json(self, *args: str) -> dict:
        return dict(json.loads(self.kubectl(*args, "-o", "json")))

    def pids(self, pattern: str = "") -> list[int]:
        """Pids of processes whose command line has `pattern` (default: the data dir)."""
        found = subprocess.run(["pgrep", "-f", pattern or str(self.data_dir)], capture_output=True, text=True)
        return [int(p) for p in found.stdout.split()]

    def pid_matches(self, pid: int, pattern: str, timeout: float = 20) -> bool:
        """Whether process `pid` comes to have a command line matching `pattern` (it may still be
        exec-ing) while it lives, within `timeout`."""
        deadline = time.monotonic() + timeout
        delay = 0.01
        while time.monotonic() < deadline:
            if pid in self.pids(pattern):
                return True
            if not Path(f"/proc/{pid}").exists():
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        return False

    def runtime_dirs(self) -> list[Path]:
        """The temporary dirs this `up` made (named after its pid) that still exist."""
        import tempfile

        owned = re.compile(rf"(gdra|gpu-dra-cluster)-{self.proc.pid}-.+")
        return [
            p for root in {Path("/tmp"), Path(tempfile.gettempdir())} for p in root.iterdir() if owned.fullmatch(p.name)
        ]

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def metric(url: str, name: str, **labels: str) -> float | None:
    """One sample of a Prometheus endpoint (real HTTP), or None when it is not there."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return None
