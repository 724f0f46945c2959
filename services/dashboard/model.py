"""Fleet state built from ResourceSlices and ResourceClaims (one job: turn API objects into rows).

Pure functions over the decoded API objects so the server, the bench and the tests share one model.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Allocation(msgspec.Struct, frozen=True):
    namespace: str
    claim: str


class Device(msgspec.Struct):
    name: str
    product: str = ""
    memory: str = ""
    parent: str = ""
    taints: list[str] = msgspec.field(default_factory=list)
    allocation: Allocation | None = None


class Node(msgspec.Struct):
    name: str
    pool: str
    devices: list[Device] = msgspec.field(default_factory=list)


def _attr(device: dict[str, Any], key: str) -> str:
    value = (device.get("attributes") or {}).get(key) or {}
    for kind in ("string", "version", "int", "bool"):
        if kind in value:
            return str(value[kind])
    return ""


def build_fleet(slices: list[dict[str, Any]], claims: list[dict[str, Any]]) -> list[Node]:
    """Return nodes sorted by name, each device marked with the claim allocated to it."""
    allocated: dict[tuple[str, str], Allocation] = {}
    for claim in claims:
        meta = claim.get("metadata") or {}
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
        for result in results:
            allocated[(result.get("pool", ""), result.get("device", ""))] = Allocation(
                namespace=meta.get("namespace", ""), claim=meta.get("name", "")
            )
    nodes: dict[str, Node] = {}
    for rslice in slices:
        spec = rslice.get("spec") or {}
        pool = (spec.get("pool") or {}).get("name", "")
        node = nodes.setdefault(spec.get("nodeName", pool), Node(name=spec.get("nodeName", pool), pool=pool))
        for dev in spec.get("devices") or []:
            memory = ((dev.get("capacity") or {}).get("memory") or {}).get("value", "")
            node.devices.append(
                Device(
                    name=dev.get("name", ""),
                    product=_attr(dev, "productName"),
                    memory=str(memory),
                    parent=_attr(dev, "parentUUID"),
                    taints=[f"{t.get('key', '')}={t.get('value', '')}" for t in dev.get("taints") or []],
                    allocation=allocated.get((pool, dev.get("name", ""))),
                )
            )
    return [nodes[name] for name in sorted(nodes)]


def device_state(device: Device) -> str:
    """A text label per state (the page shows it besides the colour): tainted wins over claimed."""
    if device.taints:
        return "tainted"
    return "claimed" if device.allocation is not None else "free"


def counters(fleet: list[Node]) -> dict[str, dict[str, int]]:
    """Device counts by product, then by state."""
    out: dict[str, dict[str, int]] = {}
    for node in fleet:
        for device in node.devices:
            by_state = out.setdefault(device.product or "unknown", {"free": 0, "claimed": 0, "tainted": 0})
            by_state[device_state(device)] += 1
    return out
