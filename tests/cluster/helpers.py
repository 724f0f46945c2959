"""A whole local cluster for tests (real processes, real sockets), and ways to look at what pods got."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, watch

from embedded.cluster.apply import Applier
from embedded.nodeagent.pods import EDITS_ANNOTATION

# Every node: 4 full H100s and 2 A100-40GB in MIG mode, each cut as one gpu-test4 pod needs
# (2x 1g.5gb, 2g.10gb and 3g.20gb on one parent; 8 memory slices).
MIG_MACHINE = """\
gpus:
- profile: h100
  count: 4
- profile: a100-40gb
  count: 2
  mig_enabled: true
  mig_devices:
  - {profile: 2g.10gb, placement: 0}
  - {profile: 1g.5gb, placement: 2}
  - {profile: 1g.5gb, placement: 3}
  - {profile: 3g.20gb, placement: 4}
"""


async def pods_in(api: client.ApiClient, namespace: str) -> list[dict[str, Any]]:
    listed = await client.CoreV1Api(api).list_namespaced_pod(namespace)
    return list(api.sanitize_for_serialization(listed).get("items") or [])


def running(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


async def wait_pods(api: client.ApiClient, namespace: str, count: int, ready: bool = True,
                    timeout: float = 60.0) -> list[dict[str, Any]]:
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
            async for _ in w.stream(client.CoreV1Api(api).list_namespaced_pod, namespace,
                                    timeout_seconds=min(left, 5)):
                break
    states = {p["metadata"]["name"]: ((p.get("status") or {}).get("phase"),
                                      [c.get("message") for c in (p.get("status") or {}).get("conditions") or []
                                       if c.get("message")]) for p in pods}
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
