"""`gpu-dra demo` (what `make run` runs): sample workloads on a full local cluster, shown and torn down.

Brings up a local cluster (two simulated nodes with H100s and a MIG-partitioned A100), applies the
sample workloads in `examples/workloads/`, waits for their pods, prints what every container got
(devices, UUIDs, sharing), the first lines each container logged (its `nvidia-smi -L`), and a waterfall of one claim-preparation trace, then tears it all down.
Exit code 0 only when every sample pod ran.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from embedded.cluster.apply import Applier, load_documents
from embedded.cluster.local import ClusterConfig, LocalCluster, cluster_main
from embedded.cluster.waterfall import read_spans, render, traces_with
from embedded.nodeagent.pods import EDITS_ANNOTATION

WORKLOADS = Path(__file__).resolve().parents[2] / "examples" / "workloads"
DEMO_MACHINE = """\
gpus:
- profile: h100
  count: 4
- profile: a100-40gb
  mig_enabled: true
  mig_devices:
  - {profile: 3g.20gb, placement: 0}
  - {profile: 2g.10gb, placement: 4}
  - {profile: 1g.5gb, placement: 6}
"""


class DemoConfig(ClusterConfig, kw_only=True, forbid_unknown_fields=True):
    workloads: str = ""  # a folder of manifests (default: examples/workloads)
    wait_timeout: float = 120.0


async def _pods(api: client.ApiClient, namespaces: set[str]) -> list[dict[str, Any]]:
    listed = await client.CoreV1Api(api).list_pod_for_all_namespaces()
    pods = api.sanitize_for_serialization(listed).get("items") or []
    return [p for p in pods if p["metadata"]["namespace"] in namespaces]


def _running(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running"


async def _why_not_running(api: client.ApiClient, pod: dict[str, Any]) -> str:
    """The kubelet's last FailedPrepareDynamicResources message for the pod, else its conditions' message."""
    meta = pod["metadata"]
    events = await client.CoreV1Api(api).list_namespaced_event(
        meta["namespace"], field_selector=f"involvedObject.uid={meta['uid']},reason=FailedPrepareDynamicResources")
    if events.items:
        return str(max(events.items, key=lambda e: str(e.last_timestamp or "")).message)
    conds = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    return str((conds.get("PodScheduled") or conds.get("Ready") or {}).get("message", ""))


async def wait_for_pods(api: client.ApiClient, namespaces: set[str], timeout: float) -> list[dict[str, Any]]:
    """Until every pod in `namespaces` runs (or `timeout`), woken by pod watch events."""
    from kubernetes_asyncio import watch

    deadline = time.monotonic() + timeout
    while True:
        pods = await _pods(api, namespaces)
        if pods and all(_running(p) for p in pods):
            return pods
        left = deadline - time.monotonic()
        if left <= 0:
            return pods
        w = watch.Watch()
        async with w:
            async for _ in w.stream(client.CoreV1Api(api).list_pod_for_all_namespaces,
                                    timeout_seconds=max(1, int(min(left, 5)))):
                break  # something changed: look again


async def _device_uuids(api: client.ApiClient) -> dict[str, str]:
    """'pool/device' -> UUID, from the published ResourceSlices."""
    listed = await client.CustomObjectsApi(api).list_cluster_custom_object("resource.k8s.io", "v1", "resourceslices")
    out: dict[str, str] = {}
    for s in listed.get("items") or []:
        pool = s["spec"]["pool"]["name"]
        for d in s["spec"].get("devices") or []:
            uuid = ((d.get("attributes") or {}).get("uuid") or {}).get("string")
            if uuid:
                out[f"{pool}/{d['name']}"] = uuid
    return out


async def _sharing(api: client.ApiClient, pod: dict[str, Any]) -> str:
    """The sharing strategy from the claims' opaque GpuConfig (exclusive when none)."""
    custom = client.CustomObjectsApi(api)
    ns = pod["metadata"]["namespace"]
    modes: set[str] = set()
    names = [e.get("resourceClaimName") for e in pod["spec"].get("resourceClaims") or []]
    names += [s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []]
    for name in filter(None, names):
        claim = await custom.get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", name)
        configs = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("config") or []
        for c in configs:
            params = (c.get("opaque") or {}).get("parameters") or {}
            strategy = (params.get("sharing") or {}).get("strategy")
            if strategy:
                modes.add(strategy)
        if len({r.get("uid") for r in (claim.get("status") or {}).get("reservedFor") or []}) > 1:
            modes.add("shared claim")
    return ", ".join(sorted(modes)) or "exclusive"


async def print_table(api: client.ApiClient, pods: list[dict[str, Any]]) -> None:
    uuids = await _device_uuids(api)
    rows = [("POD", "CONTAINER", "NODE", "DEVICES", "UUIDS", "SHARING")]
    for pod in sorted(pods, key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"])):
        edits = json.loads((pod["metadata"].get("annotations") or {}).get(EDITS_ANNOTATION, "{}"))
        sharing = await _sharing(api, pod)
        name = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        for container, got in sorted(edits.items()):
            devices = got.get("devices") or []
            rows.append((name, container, pod["spec"].get("nodeName", ""),
                         " ".join(d.split("/", 1)[1] for d in devices),
                         " ".join(uuids.get(d, "?")[:12] for d in devices), sharing))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


async def _log_head(api: client.ApiClient, pod: dict[str, Any], container: str, lines: int,
                    timeout: float = 5.0) -> list[str]:
    """The first `lines` of a container's log through the API server (waiting a little for its first line)."""
    import asyncio

    meta = pod["metadata"]
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = await client.CoreV1Api(api).read_namespaced_pod_log(meta["name"], meta["namespace"],
                                                                       container=container)
        except client.ApiException as exc:
            text = ""
            if time.monotonic() >= deadline:
                return [f"(no log: {exc.status} {exc.reason})"]
        if text or time.monotonic() >= deadline:
            return str(text).splitlines()[:lines] or ["(no output yet)"]
        await asyncio.sleep(0.2)


async def print_logs(api: client.ApiClient, pods: list[dict[str, Any]], lines: int = 3) -> None:
    """Each container's first log lines, as `kubectl logs POD -c CONTAINER | head` shows them."""
    for pod in sorted(pods, key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"])):
        for c in pod["spec"].get("containers") or []:
            print(f"  kubectl logs -n {pod['metadata']['namespace']} {pod['metadata']['name']} -c {c['name']}:")
            for line in await _log_head(api, pod, c["name"], lines):
                print(f"    {line}")


async def _demo(cfg: DemoConfig) -> int:
    folder = Path(cfg.workloads) if cfg.workloads else WORKLOADS
    manifests = sorted(folder.glob("*.yaml"))
    if not manifests:
        print(f"gpu-dra demo: no manifests in {folder}", file=sys.stderr)
        return 2
    print("starting a local GPU cluster:")
    cluster = LocalCluster(cfg, progress=lambda line: print(f"  {line}", flush=True))
    if not cfg.machine and cfg.gpus == ClusterConfig().gpus:
        cluster.data_dir.mkdir(parents=True, exist_ok=True)
        machine = cluster.data_dir / "demo-machine.yaml"
        machine.write_text(DEMO_MACHINE)
        cfg.machine = str(machine)
    cluster.extra_env["GPU_DRA_OTEL_EXPORTER"] = f"file:{cluster.data_dir / 'traces.jsonl'}"
    async with cluster:
        api = await cluster.api_client()
        applier = Applier(api)
        namespaces: set[str] = set()
        print(f"\napplying {len(manifests)} sample workloads from {folder}:")
        for path in manifests:
            docs = load_documents(path)
            for doc in docs:
                await applier.create(doc)
                if doc["kind"] == "Namespace":
                    namespaces.add(doc["metadata"]["name"])
                elif (doc.get("metadata") or {}).get("namespace"):
                    namespaces.add(doc["metadata"]["namespace"])
            print(f"  {path.name}")
        started = time.monotonic()
        pods = await wait_for_pods(api, namespaces, cfg.wait_timeout)
        running = [p for p in pods if _running(p)]
        print(f"\n{len(running)}/{len(pods)} pods running after {time.monotonic() - started:.1f}s:\n")
        await print_table(api, running)
        if cfg.runtime != "none" and running:
            print("\nwhat each container printed (its first lines):\n")
            await print_logs(api, running)
        for pod in pods:
            if not _running(pod):
                why = await _why_not_running(api, pod)
                print(f"  NOT RUNNING {pod['metadata']['namespace']}/{pod['metadata']['name']}: {why}")
        traces = traces_with(read_spans(cluster.data_dir / "traces.jsonl"), "NodePrepareResources")
        if traces:
            print("\none claim preparation, as traced across the services:\n")
            print(render(traces[0]))
        ok = bool(pods) and len(running) == len(pods)
    print("\ncluster stopped; nothing left running.")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return cluster_main(DemoConfig, argv, prog="gpu-dra demo", description=__doc__ or "", run=_demo)
