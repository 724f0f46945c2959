"""`gpu-dra explain pod|claim NS/NAME`: why a pod or claim is, or is not, allocated, and why a bound
pod is stuck in prepare (the kubelet's last `FailedPrepareDynamicResources` Event, its devices' taints
in the ResourceSlices, the node's Ready condition and taints).

Reads the cluster once: for a pod only what its explanation needs (`load_pod`, what the dashboard's
role grants it: deploy/kubernetes/base/rbac.yaml), for a claim the scheduler's whole state. Has the
selectors that the scheduler would not run inline evaluated in a CEL worker (`celsandbox`, as the
scheduler does, so a runaway selector reports "actual cost limit exceeded" instead of hanging the
command), then prints the allocation that exists or what the scheduler's plan says about every node
(`report_text`, all nodes tried). Exit 0 with a report, 1 when the object does not exist or the API
cannot be reached, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from fractions import Fraction
from typing import Any

import msgspec

from embedded.scheduler.allocator import schedule
from embedded.scheduler.capacity import Capacity, device_capacities
from embedded.scheduler.celsandbox import CelSandbox
from embedded.scheduler.explain import report_text
from embedded.scheduler.plan import plan_pod
from embedded.scheduler.pools import SliceIndex
from embedded.scheduler.report import NodeReport, RequestReport
from embedded.scheduler.requests import claim_selectors
from embedded.scheduler.state import ClusterState, load_state
from embedded.scheduler.values import format_quantity
from shared.kube.client import kube_api_client
from shared.kube.resources import (
    DEVICECLASSES,
    EVENTS,
    NAMESPACES,
    NODES,
    PODS,
    RESOURCECLAIMS,
    RESOURCESLICES,
    Kube,
)
from shared.kube.rest import ApiError

Obj = dict[str, Any]
FAILED_PREPARE = "FailedPrepareDynamicResources"  # the kubelet's Event reason


class NotFound(Exception):
    pass


def _allocation_lines(claim: Obj) -> list[str]:
    md, status = claim["metadata"], claim.get("status") or {}
    key = f"{md.get('namespace')}/{md.get('name')}"
    allocation = status.get("allocation")
    if not allocation:
        return [f"claim {key}: not allocated"]
    lines = [f"claim {key}: allocated"]
    for r in (allocation.get("devices") or {}).get("results") or []:
        admin = " (admin access)" if r.get("adminAccess") else ""
        consumed = ", ".join(f"{k} {v}" for k, v in (r.get("consumedCapacity") or {}).items())
        share = f" (share {r['shareID']}{': ' + consumed if consumed else ''})" if r.get("shareID") else ""
        lines.append(
            f"  request {r.get('request')}: {r.get('driver')} pool {r.get('pool')} device {r.get('device')}"
            f"{admin}{share}"
        )
    users = [f"{r.get('resource')}/{r.get('name')}" for r in status.get("reservedFor") or []]
    lines.append(f"  reserved for: {', '.join(users) if users else 'nobody (it will be freed)'}")
    return lines


def _taints(taints: list[Obj] | None) -> str:
    return ", ".join(
        f"{t.get('key')}{'=' + str(t['value']) if t.get('value') else ''}:{t.get('effect')}" for t in taints or []
    )


def _device_taints(state: ClusterState, claim: Obj) -> dict[str, str]:
    """driver/pool/device -> its taints in the ResourceSlices, for the claim's allocated devices."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    wanted = {(r.get("driver"), r.get("pool"), r.get("device")) for r in results}
    found: dict[str, str] = {}
    for sl in state.values_slices():
        spec = sl.get("spec") or {}
        pool = (spec.get("pool") or {}).get("name")
        for dev in spec.get("devices") or []:
            if (spec.get("driver"), pool, dev.get("name")) in wanted and dev.get("taints"):
                found[f"{spec.get('driver')}/{pool}/{dev.get('name')}"] = _taints(dev["taints"])
    return found


def _prepare_lines(state: ClusterState, pod: Obj, node: str, claims: list[Obj], events: list[Obj]) -> list[str]:
    """Why a bound pod is not running: the prepare failure the kubelet reported, the devices, the node."""
    uid = pod["metadata"].get("uid")
    failures = [
        e for e in events if e.get("reason") == FAILED_PREPARE and (e.get("involvedObject") or {}).get("uid") == uid
    ]
    lines: list[str] = []
    if failures:
        last = max(failures, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
        count = sum(int(e.get("count") or 1) for e in failures)
        lines.append(
            f"prepare on node {node} failed ({count}x, last at {last.get('lastTimestamp')}): {last.get('message')}"
        )
    else:
        lines.append(f"waiting for the kubelet on node {node} to prepare the claims (no failure reported)")
    for claim in claims:
        for device, taints in sorted(_device_taints(state, claim).items()):
            lines.append(f"  device {device} is tainted: {taints}")
    node_obj = state.get(NODES, "", node)
    if node_obj is None:
        lines.append(f"node {node}: not found (deleted?)")
        return lines
    ready = next((c for c in (node_obj.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
    health = (
        (
            f"Ready={ready.get('status')}"
            + (f" ({ready.get('reason')}: {ready.get('message')})" if ready.get("status") != "True" else "")
        )
        if ready
        else "no Ready condition"
    )
    taints = _taints((node_obj.get("spec") or {}).get("taints"))
    lines.append(f"node {node}: {health}" + (f"; taints: {taints}" if taints else ""))
    return lines


def explain_pod(
    state: ClusterState, namespace: str, name: str, events: list[Obj] | None = None, index: SliceIndex | None = None
) -> str:
    pod = state.get(PODS, namespace, name)
    if pod is None:
        raise NotFound(f"pod {namespace}/{name} not found")
    node = (pod.get("spec") or {}).get("nodeName")
    names, missing = state.pod_claim_names(pod)
    lines = [f"pod {namespace}/{name}: " + (f"bound to node {node}" if node else "not scheduled")]
    cond = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"), None)
    if cond and cond.get("status") == "False":
        lines.append(f"PodScheduled=False ({cond.get('reason')}): {cond.get('message')}")
    lines += [f"missing: {m}" for m in missing]
    claims: list[Obj] = []
    for claim_name in names:
        claim = state.get(RESOURCECLAIMS, namespace, claim_name)
        assert claim is not None
        claims.append(claim)
        lines += _allocation_lines(claim)
    if node and (pod.get("status") or {}).get("phase", "Pending") == "Pending":
        lines += _prepare_lines(state, pod, node, claims, events or [])
    if not node and not missing:
        plan = plan_pod(state, pod, index or SliceIndex(state.values_slices()), all_nodes=True)
        for n, why in sorted(plan.node_rejections.items()):
            lines.append(f"node {n}: skipped: {why}")
        if plan.outcome is not None:
            lines.append(report_text(plan.outcome.reports, plan.outcome.problems))
        elif plan.message:
            lines.append(plan.message)
        elif plan.node:
            lines.append(f"every claim is allocated; the pod can go to node {plan.node}")
    if not names and not missing:
        lines.append("the pod has no resource claims")
    return "\n".join(lines)


def _left_of(cap: Capacity, used: Fraction) -> str:
    return f"{cap.key} {format_quantity(max(cap.value - used, Fraction(0)))} of {format_quantity(cap.value)}"


def _left_lines(state: ClusterState, claim: Obj) -> list[str]:
    """For each shared device the claim holds a share of: how many shares hold it, and what is left of each
    capacity they consume (`device gpu-0: 8 shares; left: memory 0 of 80Gi, compute 10 of 100`)."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    wanted = {(r.get("driver"), r.get("pool"), r.get("device")) for r in results if r.get("shareID")}
    lines: list[str] = []
    for sl in state.values_slices() if wanted else []:
        spec = sl.get("spec") or {}
        for device in spec.get("devices") or []:
            did = (str(spec.get("driver")), str((spec.get("pool") or {}).get("name")), str(device.get("name")))
            if did not in wanted:
                continue
            used = state.allocated.shared.get(did, {})
            left = [
                _left_of(cap, used[qname])
                for qname, cap in device_capacities(device, did[0]).items()
                if used.get(qname)
            ]
            count = state.allocated.share_count(did)
            lines.append(f"  device {did[2]}: {count} share{'s' if count != 1 else ''}; left: {', '.join(left)}")
    return lines


def explain_claim(state: ClusterState, namespace: str, name: str, index: SliceIndex | None = None) -> str:
    claim = state.get(RESOURCECLAIMS, namespace, name)
    if claim is None:
        raise NotFound(f"resourceclaim {namespace}/{name} not found")
    lines = [*_allocation_lines(claim), *_left_lines(state, claim)]
    if not (claim.get("status") or {}).get("allocation"):
        outcome = schedule(
            [claim],
            state.classes(),
            index or SliceIndex(state.values_slices()),
            state.allocated,
            state.values(NODES),
            admin_namespaces=state.admin_namespaces(),
            all_nodes=True,
        )
        lines.append(report_text(outcome.reports, outcome.problems))
    return "\n".join(lines)


class Waiting(msgspec.Struct, frozen=True):
    """A pod waiting for devices in one line each (the fleet page's pending-pods panel): what its claims ask for
    and why no node gives it to them, from the same plan `explain_pod` reports in full."""

    asks: str
    reason: str


def _asks(claims: list[Obj]) -> str:
    """`2 x gpu.nvidia.com where <selector>` per request of each claim, `; `-joined."""
    parts: list[str] = []
    for claim in claims:
        for req in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
            exact = req.get("exactly") or req
            options = [exact] if req.get("exactly") or req.get("deviceClassName") else req.get("firstAvailable") or []
            texts = []
            for option in options:
                count = "all" if option.get("allocationMode") == "All" else str(option.get("count") or 1)
                where = " and ".join(
                    str((sel.get("cel") or {}).get("expression") or "") for sel in option.get("selectors") or []
                )
                texts.append(f"{count} x {option.get('deviceClassName')}" + (f" where {where}" if where else ""))
            parts.append(" or ".join(texts))
    return "; ".join(parts)


def _shortfall(reports: list[NodeReport]) -> str:
    """ "not enough capacity: ..." when on every node some request has fewer eligible devices than it wants."""
    worst: RequestReport | None = None
    for report in reports:
        if report.fits:
            return ""
        short = [
            r for r in report.failed_requests() if not r.error and r.wanted.isdigit() and r.eligible < int(r.wanted)
        ]
        if not short:
            return ""
        best = max(short, key=lambda r: r.eligible)
        if worst is None or best.eligible > worst.eligible:
            worst = best
    if worst is None:
        return ""
    why = "; ".join(f"{r.count} {r.reason}" for r in worst.rejections[:2])
    return (
        f"not enough capacity: claim {worst.claim} request {worst.request} wants {worst.wanted} "
        f"{worst.device_class}, no node has more than {worst.eligible} that it can have" + (f" ({why})" if why else "")
    )


def waiting_pod(state: ClusterState, namespace: str, name: str, index: SliceIndex | None = None) -> Waiting:
    """What an unscheduled pod asks for and why it waits (NotFound when the pod is gone)."""
    pod = state.get(PODS, namespace, name)
    if pod is None:
        raise NotFound(f"pod {namespace}/{name} not found")
    names, missing = state.pod_claim_names(pod)
    claims = [c for c in (state.get(RESOURCECLAIMS, namespace, n) for n in names) if c is not None]
    if missing:
        return Waiting(asks=_asks(claims), reason="waiting for its claims: " + "; ".join(missing))
    plan = plan_pod(state, pod, index or SliceIndex(state.values_slices()), all_nodes=True)
    reason = plan.message or (f"every claim is allocated; the pod can go to node {plan.node}" if plan.node else "")
    if plan.outcome is not None and not plan.outcome.problems and not plan.node_rejections:
        reason = _shortfall(plan.outcome.reports) or reason
    return Waiting(asks=_asks(claims), reason=reason)


async def why_waiting(namespace: str, name: str, kube: Kube) -> Waiting:
    """`waiting_pod` on what `load_pod` reads, with the selectors settled in a CEL worker first."""
    state, _ = await load_pod(kube, namespace, name)
    index = SliceIndex(state.values_slices())
    await _evaluate_selectors(state, _claims_of(state, "pod", namespace, name), index)
    return waiting_pod(state, namespace, name, index)


async def load_pod(kube: Kube, namespace: str, name: str) -> tuple[ClusterState, list[Obj]]:
    """What explaining one pod reads, and no more: the pod; every claim (the devices taken), slice, node and
    device class (the plan); its namespace (admin access); its Events. No other pod is read, so the plan
    orders nodes by their allocated devices alone."""
    try:
        pod = await kube.get(PODS, namespace, name)
    except ApiError as exc:
        if exc.not_found:
            raise NotFound(f"pod {namespace}/{name} not found") from exc
        raise
    uid = (pod.get("metadata") or {}).get("uid")
    (claims, _), (slices, _), (nodes, _), (classes, _), ns, (events, _) = await asyncio.gather(
        kube.list(RESOURCECLAIMS),
        kube.list(RESOURCESLICES),
        kube.list(NODES),
        kube.list(DEVICECLASSES),
        kube.get(NAMESPACES, None, namespace),
        kube.list(EVENTS, namespace, field_selector=f"involvedObject.uid={uid}"),
    )
    state = ClusterState()
    for res, items in (
        (PODS, [pod]),
        (RESOURCECLAIMS, claims),
        (RESOURCESLICES, slices),
        (NODES, nodes),
        (DEVICECLASSES, classes),
        (NAMESPACES, [ns]),
    ):
        state.replace_all(res, items)
    return state, events


async def explain(kind: str, namespace: str, name: str, kubeconfig: str) -> str:
    async with await kube_api_client(kubeconfig) as api:
        kube = Kube(api)
        if kind == "pod":
            state, events = await load_pod(kube, namespace, name)
        else:
            state, events = await load_state(kube), []
    index = SliceIndex(state.values_slices())
    await _evaluate_selectors(state, _claims_of(state, kind, namespace, name), index)
    if kind == "pod":
        return explain_pod(state, namespace, name, events, index)
    return explain_claim(state, namespace, name, index)


def _claims_of(state: ClusterState, kind: str, namespace: str, name: str) -> list[Obj]:
    """The unallocated claims a plan for the pod (or the claim itself) would allocate."""
    if kind == "pod":
        pod = state.get(PODS, namespace, name)
        names = state.pod_claim_names(pod)[0] if pod is not None else []
    else:
        names = [name]
    found = (state.get(RESOURCECLAIMS, namespace, n) for n in names)
    return [c for c in found if c is not None and not (c.get("status") or {}).get("allocation")]


async def _evaluate_selectors(state: ClusterState, claims: list[Obj], index: SliceIndex) -> None:
    """The selectors the scheduler would evaluate in its CEL worker, evaluated in one here first."""
    sandbox = CelSandbox()
    try:
        for selector in sandbox.unsettled(claim_selectors(claims, state.classes()), index):
            await sandbox.settle(selector, index)
    finally:
        await sandbox.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-dra explain", description="Why a pod or claim is (not) allocated.")
    parser.add_argument("kind", choices=["pod", "claim"], help="what to explain")
    parser.add_argument("target", metavar="NS/NAME", help="namespace/name (a bare NAME means namespace default)")
    parser.add_argument("--kubeconfig", default="", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    namespace, _, name = args.target.rpartition("/")
    namespace = namespace or "default"
    if not name or "/" in namespace:
        print(f"gpu-dra explain: {args.target!r} is not NS/NAME; write it as e.g. default/my-pod", file=sys.stderr)
        return 2
    try:
        print(asyncio.run(explain(args.kind, namespace, name, args.kubeconfig)))
    except NotFound as exc:
        print(f"gpu-dra explain: {exc} (check the namespace and name with kubectl get)", file=sys.stderr)
        return 1
    except OSError as exc:  # the API server out of reach (or a file): fix the target, exit 2
        print(f"gpu-dra explain: cannot read the cluster: {exc}", file=sys.stderr)
        return 2
    except ApiError as exc:
        print(f"gpu-dra explain: cannot read the cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
