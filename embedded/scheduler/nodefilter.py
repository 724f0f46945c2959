"""Which nodes a pod may go to before devices are looked at, and in what order they are tried.

Owns the node checks kube-scheduler runs besides DRA: Ready, not unschedulable, the pod's
nodeSelector, required node affinity, node taints (NoSchedule/NoExecute) against the pod's
tolerations, and the node pins of claims already allocated. Order: least-allocated first (devices
held by claims on the node, then pods bound there), then name, so that pods spread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from embedded.scheduler.pools import selector_matches
from embedded.scheduler.taints import blocking_taint, taint_text

Obj = dict[str, Any]


def node_ready(node: Mapping[str, Any]) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def node_rejection(
    pod: Mapping[str, Any], node: Mapping[str, Any], pins: Iterable[tuple[str, Mapping[str, Any]]] = ()
) -> str | None:
    """Why the pod cannot go to this node regardless of devices, or None."""
    spec = pod.get("spec") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    if not node_ready(node):
        return "node is not Ready"
    if (node.get("spec") or {}).get("unschedulable"):
        return "node is unschedulable (cordoned)"
    for k, v in (spec.get("nodeSelector") or {}).items():
        if labels.get(k) != v:
            return f"pod nodeSelector {k}={v} does not match"
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required and not selector_matches(required, node):
        return "pod's required node affinity does not match"
    taint = blocking_taint((node.get("spec") or {}).get("taints") or [], spec.get("tolerations") or [])
    if taint is not None:
        return f"taint {taint_text(taint)} is not tolerated"
    for claim_name, selector in pins:
        if selector and not selector_matches(selector, node):
            return f"claim {claim_name} is allocated on devices not reachable from this node"
    return None


def order_nodes(nodes: list[Obj], devices_per_node: Mapping[str, int], pods_per_node: Mapping[str, int]) -> list[Obj]:
    def load(node: Obj) -> tuple[int, int, str]:
        name = str((node.get("metadata") or {}).get("name") or "")
        return devices_per_node.get(name, 0), pods_per_node.get(name, 0), name

    return sorted(nodes, key=load)
