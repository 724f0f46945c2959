"""One scheduling decision for one pod over a ClusterState, without writing anything.

Owns: the pod's claims (missing ones make it wait), node pins of claims already allocated, the node
checks and order, the allocator call for the unallocated claims, and the message when nothing fits.
The loop writes what a Plan says; `gpu-dra explain` prints it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from embedded.scheduler.allocator import ScheduleOutcome, schedule
from embedded.scheduler.explain import condition_message
from embedded.scheduler.nodefilter import node_rejection, order_nodes
from embedded.scheduler.pools import SliceIndex
from embedded.scheduler.state import ClusterState, claim_key
from shared.kube.resources import NODES, PODS, RESOURCECLAIMS, RESOURCESLICES

Obj = dict[str, Any]
MAX_RESERVED = 256


class Plan(msgspec.Struct, kw_only=True):
    """What to do with one pod: wait (missing claims), bind to `node` (with new allocations), or report why not."""

    pod: str
    missing: list[str] = msgspec.field(default_factory=list)
    claims: list[str] = msgspec.field(default_factory=list)  # ns/name of every claim of the pod
    node: str | None = None
    allocations: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)  # ns/name -> allocation
    node_rejections: dict[str, str] = msgspec.field(default_factory=dict)
    outcome: ScheduleOutcome | None = None
    message: str = ""


class IndexCache:
    """The SliceIndex, rebuilt only when slices changed (keeping compiled CEL environments)."""

    def __init__(self) -> None:
        self.index: SliceIndex | None = None
        self.dirty = True

    def get(self, state: ClusterState) -> SliceIndex:
        if self.index is None or self.dirty:
            self.index = SliceIndex(state.values(RESOURCESLICES), previous=self.index)
            self.dirty = False
        return self.index


def pool_nodes(state: ClusterState) -> dict[tuple[str, str], str]:
    out: dict[tuple[str, str], str] = {}
    for s in state.values(RESOURCESLICES):
        spec = s.get("spec") or {}
        if spec.get("nodeName"):
            out[(str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", "")))] = str(spec["nodeName"])
    return out


def load_per_node(state: ClusterState) -> tuple[dict[str, int], dict[str, int]]:
    devices: dict[str, int] = {}
    owners = pool_nodes(state)
    for driver, pool, _ in state.allocated.devices:
        node = owners.get((driver, pool))
        if node:
            devices[node] = devices.get(node, 0) + 1
    pods: dict[str, int] = {}
    for pod in state.values(PODS):
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            pods[node] = pods.get(node, 0) + 1
    return devices, pods


def reserved_for_pod(claim: Obj, uid: str) -> bool:
    return any(r.get("uid") == uid for r in (claim.get("status") or {}).get("reservedFor") or [])


def plan_pod(state: ClusterState, pod: Obj, index: SliceIndex, *, all_nodes: bool = False) -> Plan:
    md = pod.get("metadata") or {}
    ns, uid = str(md.get("namespace") or ""), str(md.get("uid") or "")
    plan = Plan(pod=f"{ns}/{md.get('name')}")
    names, plan.missing = state.pod_claim_names(pod)
    if plan.missing:
        plan.message = "waiting for the pod's claims: " + "; ".join(plan.missing)
        return plan
    claims = [state.get(RESOURCECLAIMS, ns, n) for n in names]
    plan.claims = [f"{ns}/{n}" for n in names]
    pins: list[tuple[str, Any]] = []
    pending: list[Mapping[str, Any]] = []
    for claim in claims:
        assert claim is not None
        status = claim.get("status") or {}
        if status.get("allocation"):
            reserved = status.get("reservedFor") or []
            if not reserved_for_pod(claim, uid) and len(reserved) >= MAX_RESERVED:
                plan.message = f"claim {claim_key(claim)} is already reserved for {MAX_RESERVED} consumers"
                return plan
            pins.append((claim_key(claim), status["allocation"].get("nodeSelector")))
        elif (claim.get("metadata") or {}).get("deletionTimestamp"):
            plan.message = f"claim {claim_key(claim)} is being deleted; it cannot be allocated"
            return plan
        else:
            pending.append(claim)
    nodes = state.values(NODES)
    candidates: list[Obj] = []
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name") or "")
        why = node_rejection(pod, node, pins)
        if why:
            plan.node_rejections[name] = why
        else:
            candidates.append(node)
    devices, pods = load_per_node(state)
    candidates = order_nodes(candidates, devices, pods)
    if not candidates:
        detail = "; ".join(f"node {n}: {why}" for n, why in sorted(plan.node_rejections.items()))
        plan.message = f"0/{len(nodes)} nodes are available: {detail or 'there are no nodes'}"
        return plan
    if not pending:
        plan.node = str(candidates[0]["metadata"]["name"])
        return plan
    outcome = schedule(
        pending,
        state.classes(),
        index,
        state.allocated,
        candidates,
        admin_namespaces=state.admin_namespaces(),
        all_nodes=all_nodes,
    )
    plan.outcome = outcome
    if outcome.node is None:
        plan.message = condition_message(outcome.reports, outcome.problems)
        if plan.node_rejections:
            plan.message += (
                " (also: " + "; ".join(f"node {n}: {why}" for n, why in sorted(plan.node_rejections.items())) + ")"
            )
        return plan
    plan.node = outcome.node
    plan.allocations = dict(outcome.allocations)
    return plan
