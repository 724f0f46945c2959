"""`gpu-dra demo` (what `make run` runs): sample workloads on a full local cluster, checked, shown and torn down.

Brings up a local cluster (two simulated nodes with H100s, a MIG-partitioned A100 and an L40S), applies the
sample workloads in `examples/workloads/` (one of them a NodeConfig sharing gpu-node-0's L40S among tenants),
waits for their pods, prints what every container got (devices, UUIDs, sharing), reads every container's log
and checks that it names exactly the GPUs and MIG devices its claims were allocated and the sharing they asked
for (`democheck.py`), prints a waterfall of one claim-preparation trace and what to run next, then tears it all
down (`--keep`: leaves it up until Ctrl-C). A sample pod annotated `EXPECT_PENDING` must not run: it passes when
the scheduler holds it back saying the annotation's text (a tenant asking for more than its GPU has left).
Exit code 0 only when every other sample pod ran, every held-back one said why, and every log checked out; 1
names each mismatch.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
from kubernetes_asyncio import client

from embedded.cluster import democheck
from embedded.cluster.apply import Applier, load_documents
from embedded.cluster.clustermain import cluster_main
from embedded.cluster.local import ClusterConfig, LocalCluster
from embedded.cluster.up import ready_lines, serve_until_stopped
from embedded.cluster.waterfall import read_spans, render, traces_with
from embedded.nodeagent.podclaims import EDITS_ANNOTATION
from shared.backoff import Backoff

WORKLOADS = Path(__file__).resolve().parents[2] / "examples" / "workloads"
# on a sample pod that must not run: a text its PodScheduled=False message must hold (a tenant past its GPU's shares)
EXPECT_PENDING = "gpu-dra.nvidia.com/demo-expect-pending"
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
- profile: l40s
  count: 1
"""


class DemoConfig(ClusterConfig, kw_only=True, forbid_unknown_fields=True):
    workloads: Annotated[
        str, msgspec.Meta(description=("a folder of manifests to apply; empty: examples/workloads"))
    ] = ""
    wait_timeout: Annotated[float, msgspec.Meta(gt=0, description=("seconds for every sample pod to run"))] = 120.0
    log_timeout: Annotated[
        float, msgspec.Meta(gt=0, description=("seconds for every container's log to show its devices and sharing"))
    ] = 20.0
    keep: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "leave the cluster up after the checks (fleet page, kubectl, gpu-dra events tail) until Ctrl-C"
            )
        ),
    ] = False


NEXT_STEPS = """\
what next:
  gpu-dra up                 a local GPU cluster of your own: kubectl, your claims, the fleet page
  gpu-dra demo --keep        this demo, left running until Ctrl-C
  docs/local-cluster.md      the local cluster; docs/sharing.md: GPU sharing; README.md: the services"""


async def _pods(api: client.ApiClient, namespaces: set[str]) -> list[dict[str, Any]]:
    listed = await client.CoreV1Api(api).list_pod_for_all_namespaces()
    pods = api.sanitize_for_serialization(listed).get("items") or []
    return [p for p in pods if p["metadata"]["namespace"] in namespaces]


def _running(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running"


def expect_pending(pod: dict[str, Any]) -> str:
    """What a sample pod that must not run says it must be told why (its EXPECT_PENDING annotation); "" for a pod
    that must run."""
    return str(((pod.get("metadata") or {}).get("annotations") or {}).get(EXPECT_PENDING) or "")


def _unschedulable(pod: dict[str, Any]) -> str:
    """The pod's PodScheduled=False message ("" while it has none)."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return str(cond.get("message") or "")
    return ""


def _settled(pod: dict[str, Any]) -> bool:
    """Running; or, for a pod expected to stay Pending, unschedulable for the reason it expects, or scheduled
    after all (a failure: nothing more to wait for)."""
    want = expect_pending(pod)
    if not want:
        return _running(pod)
    return want in _unschedulable(pod) or bool((pod.get("spec") or {}).get("nodeName"))


async def _why_not_running(api: client.ApiClient, pod: dict[str, Any]) -> str:
    """The kubelet's last FailedPrepareDynamicResources message for the pod, else its conditions' message."""
    meta = pod["metadata"]
    events = await client.CoreV1Api(api).list_namespaced_event(
        meta["namespace"], field_selector=f"involvedObject.uid={meta['uid']},reason=FailedPrepareDynamicResources"
    )
    if events.items:
        return str(max(events.items, key=lambda e: str(e.last_timestamp or "")).message)
    conds = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    return str((conds.get("PodScheduled") or conds.get("Ready") or {}).get("message", ""))


async def wait_for_pods(api: client.ApiClient, namespaces: set[str], timeout: float) -> list[dict[str, Any]]:
    """Until every pod in `namespaces` runs, or is held back as it expects (`expect_pending`), or `timeout`;
    woken by pod watch events."""
    from kubernetes_asyncio import watch

    deadline = time.monotonic() + timeout
    while True:
        pods = await _pods(api, namespaces)
        if pods and all(_settled(p) for p in pods):
            return pods
        left = deadline - time.monotonic()
        if left <= 0:
            return pods
        w = watch.Watch()
        async with w:
            async for _ in w.stream(
                client.CoreV1Api(api).list_pod_for_all_namespaces, timeout_seconds=max(1, int(min(left, 5)))
            ):
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
    """The sharing strategy from the claims' opaque GpuConfig, or the share each claim holds (exclusive when
    none)."""
    custom = client.CustomObjectsApi(api)
    ns = pod["metadata"]["namespace"]
    modes: set[str] = set()
    names = [e.get("resourceClaimName") for e in pod["spec"].get("resourceClaims") or []]
    names += [s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []]
    for name in filter(None, names):
        claim = await custom.get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", name)
        devices = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {})
        for result in devices.get("results") or []:
            if result.get("shareID"):  # a share of a device other claims may share too (consumable capacity)
                consumed = result.get("consumedCapacity") or {}
                amounts = [str(consumed["memory"])] if "memory" in consumed else []
                amounts += [f"{consumed['compute']}%"] if "compute" in consumed else []
                kind = "MPS share" if "compute" in consumed else "share"
                modes.add(f"{kind} {'/'.join(amounts)}".strip())
        for c in devices.get("config") or []:
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
            rows.append(
                (
                    name,
                    container,
                    pod["spec"].get("nodeName", ""),
                    " ".join(d.split("/", 1)[1] for d in devices),
                    " ".join(uuids.get(d, "?")[:12] for d in devices),
                    sharing,
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


@dataclass
class Checked:
    expected: democheck.Expected
    log: str
    wrong: list[str]


async def _log(api: client.ApiClient, namespace: str, pod: str, container: str) -> str:
    try:
        return str(await client.CoreV1Api(api).read_namespaced_pod_log(pod, namespace, container=container))
    except client.ApiException as exc:
        return f"(no log: {exc.status} {exc.reason})"


async def check_logs(api: client.ApiClient, pods: list[dict[str, Any]], timeout: float) -> list[Checked]:
    """Every container with devices: its log, read until it shows all it must (or `timeout`), and what is
    wrong with it. The pod log API has no follow here, so each log is read again with a short back-off."""
    custom = client.CustomObjectsApi(api)
    slices = await custom.list_cluster_custom_object("resource.k8s.io", "v1", "resourceslices")
    devices = democheck.slice_devices(slices.get("items") or [])
    claims: dict[str, dict[str, dict[str, Any]]] = {}
    for ns in {p["metadata"]["namespace"] for p in pods}:
        listed = await custom.list_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims")
        claims[ns] = {c["metadata"]["name"]: c for c in listed.get("items") or []}
    deadline = time.monotonic() + timeout

    async def one(want: democheck.Expected) -> Checked:
        namespace, name = want.pod.split("/", 1)
        backoff = Backoff(initial_s=0.05, cap_s=1.0)
        while True:
            log = await _log(api, namespace, name, want.container)
            if want.complete(log) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))
        log = await _log(api, namespace, name, want.container)  # once more: lines after the last expected one
        return Checked(want, log, want.mismatches(log))

    wanted = [
        w
        for pod in sorted(pods, key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"]))
        for w in democheck.expected(pod, claims[pod["metadata"]["namespace"]], devices)
    ]
    return list(await asyncio.gather(*(one(w) for w in wanted)))


def print_checked(checked: list[Checked], lines: int = 4) -> None:
    """Each container's first log lines, as `kubectl logs POD -c CONTAINER | head` shows them, and the verdict."""
    for c in checked:
        namespace, name = c.expected.pod.split("/", 1)
        verdict = "names exactly its devices" + (f" and {', '.join(c.expected.sharing)}" if c.expected.sharing else "")
        verdict += " with its own share's limits" if c.expected.limits else ""
        print(
            f"  kubectl logs -n {namespace} {name} -c {c.expected.container}:   "
            f"{'MISMATCH' if c.wrong else 'ok: ' + verdict}"
        )
        for line in c.log.splitlines()[:lines] or ["(no output)"]:
            print(f"    {line}")
        for why in c.wrong:
            print(f"    MISMATCH: {why}")


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
    if cfg.otel_exporter == "none":  # the services' spans, for the waterfall below and the fleet page
        cluster.cfg.otel_exporter = f"file:{cluster.data_dir / 'traces.jsonl'}"
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
        held = [p for p in pods if expect_pending(p)]
        pods = [p for p in pods if not expect_pending(p)]
        running = [p for p in pods if _running(p)]
        print(f"\n{len(running)}/{len(pods)} pods running after {time.monotonic() - started:.1f}s:\n")
        await print_table(api, running)
        if held:
            print("\nheld back: a claim asking more than its GPU has left (`kubectl describe pod` says why):\n")
            for pod in held:
                name, message = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}", _unschedulable(pod)
                # the scheduler's clause that names the expected reason, out of its account of every node
                why = next((part for part in message.split("; ") if expect_pending(pod) in part), message)
                print(f"  {name}: {'Running' if _running(pod) else 'Pending'}: {why or '(no reason yet)'}")
        checked: list[Checked] = []
        if cluster.cfg.runtime != "none" and running:
            print("\nwhat each container printed, checked against its claims' allocation:\n")
            checked = await check_logs(api, running, cfg.log_timeout)
            print_checked(checked)
        elif running:
            print("\nNOT CHECKED: containers were not run (--runtime none, or no bubblewrap: `make sandbox`)")
        failures = []
        for pod in pods:
            if not _running(pod):
                why = await _why_not_running(api, pod)
                failures.append(f"{pod['metadata']['namespace']}/{pod['metadata']['name']} is not running: {why}")
        failures += [f"{c.expected.pod} container {c.expected.container}: {why}" for c in checked for why in c.wrong]
        for pod in held:
            name, want = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}", expect_pending(pod)
            if pod["spec"].get("nodeName") or _running(pod):
                failures.append(
                    f"{name} was scheduled, though its claim asks for more than is left: limits did not hold"
                )
            elif want not in (got := _unschedulable(pod)):
                failures.append(f"{name} is Pending, but not saying {want!r}: {got or 'no PodScheduled=False message'}")
        traces = traces_with(read_spans(cluster.data_dir / "traces.jsonl"), "NodePrepareResources")
        if traces:
            print("\none claim preparation, as traced across the services:\n")
            print(render(traces[0]))
        if not pods:
            failures.append(f"no pods in the namespaces of {folder}")
        if failures:
            print(f"\ndemo FAILED: {len(failures)} thing(s) are not as the claims say:", file=sys.stderr)
            for line in failures:
                print(f"  {line}", file=sys.stderr)
        else:
            print(
                f"\ndemo ok: {len(pods)} pods ran"
                + (f", {len(held)} held back by the capacity left" if held else "")
                + f"; {len(checked)} container logs name exactly their allocated GPUs, MIG devices and sharing"
            )
        print(f"\n{NEXT_STEPS}")
        if cfg.keep:
            code = await serve_until_stopped(cluster, ["", *ready_lines(cluster)])
            if code:
                return code
    print("\ncluster stopped; nothing left running.")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    return cluster_main(DemoConfig, argv, prog="gpu-dra demo", description=__doc__ or "", run=_demo)
