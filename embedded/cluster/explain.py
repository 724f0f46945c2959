"""`gpu-dra explain pod|claim NS/NAME`: why a pod or claim is, or is not, allocated.

Loads the cluster once (the scheduler's own state loading), then prints the allocation that exists
or what the scheduler's plan says about every node (`report_text`, all nodes tried). Exit 0 with a
report, 1 when the object does not exist or the API cannot be reached, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from embedded.scheduler.allocator import schedule
from embedded.scheduler.explain import report_text
from embedded.scheduler.plan import plan_pod
from embedded.scheduler.pools import SliceIndex
from embedded.scheduler.state import ClusterState, load_state
from shared.kube.client import kube_api_client
from shared.kube.resources import NODES, PODS, RESOURCECLAIMS, Kube
from shared.kube.rest import ApiError

Obj = dict[str, Any]


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
        lines.append(f"  request {r.get('request')}: {r.get('driver')} pool {r.get('pool')} device {r.get('device')}"
                     f"{admin}")
    users = [f"{r.get('resource')}/{r.get('name')}" for r in status.get("reservedFor") or []]
    lines.append(f"  reserved for: {', '.join(users) if users else 'nobody (it will be freed)'}")
    return lines


def explain_pod(state: ClusterState, namespace: str, name: str) -> str:
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
    for claim_name in names:
        claim = state.get(RESOURCECLAIMS, namespace, claim_name)
        assert claim is not None
        lines += _allocation_lines(claim)
    if not node and not missing:
        plan = plan_pod(state, pod, SliceIndex(state.values_slices()), all_nodes=True)
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


def explain_claim(state: ClusterState, namespace: str, name: str) -> str:
    claim = state.get(RESOURCECLAIMS, namespace, name)
    if claim is None:
        raise NotFound(f"resourceclaim {namespace}/{name} not found")
    lines = _allocation_lines(claim)
    if not (claim.get("status") or {}).get("allocation"):
        outcome = schedule([claim], state.classes(), SliceIndex(state.values_slices()), state.allocated,
                           state.values(NODES), admin_namespaces=state.admin_namespaces(), all_nodes=True)
        lines.append(report_text(outcome.reports, outcome.problems))
    return "\n".join(lines)


async def explain(kind: str, namespace: str, name: str, kubeconfig: str) -> str:
    async with await kube_api_client(kubeconfig) as api:
        state = await load_state(Kube(api))
    return explain_pod(state, namespace, name) if kind == "pod" else explain_claim(state, namespace, name)


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
    except (ApiError, OSError) as exc:
        print(f"gpu-dra explain: cannot read the cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
