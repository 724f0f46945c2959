"""Kubernetes Events on a Node when the publisher adds or removes a device taint in its slices.

Owns what a node's devices were last published with (device -> taints, from the desired pools) and
the Events that a change makes: `DeviceTaintAdded` (Warning) and `DeviceTaintRemoved` (Normal),
involving the Node, from component `gpu-dra-publisher`, so `kubectl describe node` and `kubectl get
events` show when a GPU went bad and came back. The first sync of a node after the publisher starts
only records (what changed while it was down is not known); a failed Event write is logged, never
fails the sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.publisher.slices import DesiredPool
from shared.kube.events import event_body, record_event

COMPONENT = "gpu-dra-publisher"
ADDED = "DeviceTaintAdded"
REMOVED = "DeviceTaintRemoved"


def _taint(t: Mapping[str, Any]) -> str:
    value = f"={t['value']}" if t.get("value") else ""
    return f"{t.get('key')}{value}:{t.get('effect')}"


def pool_taints(pools: Mapping[str, DesiredPool]) -> dict[str, frozenset[str]]:
    """`driver/device` -> its taints, as `key=value:effect`, for each tainted device of the node's pools (an
    untainted device is absent: a healthy node keeps an empty dict, not an entry per device)."""
    return {
        f"{driver}/{dev.get('name')}": frozenset(_taint(t) for t in taints)
        for driver, pool in pools.items()
        for content in pool.slices
        for dev in content.devices
        if (taints := dev.get("taints"))
    }


def _devices(pools: Mapping[str, DesiredPool]) -> set[str]:
    return {f"{driver}/{dev.get('name')}" for driver, pool in pools.items() for c in pool.slices for dev in c.devices}


class TaintEvents:
    def __init__(self, api_client: Any) -> None:
        self.api = api_client
        self.known: dict[str, dict[str, frozenset[str]]] = {}  # node -> device -> taints
        self.posted = 0

    def changes(self, node: str, pools: Mapping[str, DesiredPool]) -> list[tuple[str, str, str]]:
        """(reason, device, taint) for what differs from the node's last sync; records the new state."""
        now = pool_taints(pools)
        before = self.known.get(node)
        self.known[node] = now
        if not before:  # the first sync (nothing known), or no taint before: only additions to look for
            return [] if before is None else [(ADDED, d, t) for d in sorted(now) for t in sorted(now[d])]
        present = _devices(pools)
        out: list[tuple[str, str, str]] = []
        for device in sorted(set(now) | set(before)):
            old, new = before.get(device, frozenset()), now.get(device, frozenset())
            out += [(ADDED, device, t) for t in sorted(new - old)]
            if device in present:  # a device that left the pool is no news about its health
                out += [(REMOVED, device, t) for t in sorted(old - new)]
        return out

    async def report(self, node: str, node_uid: str, pools: Mapping[str, DesiredPool]) -> None:
        involved = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}
        for reason, device, taint in self.changes(node, pools):
            verb = "added to" if reason == ADDED else "removed from"
            body = event_body(
                involved,
                reason=reason,
                component=COMPONENT,
                message=f"taint {taint} {verb} device {device} in the node's ResourceSlices",
                type="Warning" if reason == ADDED else "Normal",
            )
            if await record_event(self.api, body):
                self.posted += 1
