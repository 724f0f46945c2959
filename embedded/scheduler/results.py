"""A successful search -> `status.allocation` in the exact v1 shape (reference §5.10).

Owns `devices.results` (allocation order; `adminAccess` only when true; tolerations copied),
`devices.config` (class configs first with `source: FromClass`, then the claim's own with
`source: FromClaim`, an entry covering every request gets `requests` cleared) and `nodeSelector`.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from embedded.scheduler.capacity import consumed_text, consumption, qualify

if TYPE_CHECKING:
    from embedded.scheduler.pools import Candidate
    from embedded.scheduler.requests import ClaimRequests, Req


def _result(req: Req, device: Candidate) -> dict[str, Any]:
    out: dict[str, Any] = {"request": req.name, "driver": device.driver, "pool": device.pool, "device": device.name}
    if req.admin:
        out["adminAccess"] = True
    if req.tolerations:
        out["tolerations"] = [dict(t) for t in req.tolerations]
    if device.shareable:
        # One share of a shareable device: its own ID and what it consumes (KEP-5075).
        out["shareID"] = str(uuid.uuid4())
        requests = {qualify(name, device.driver): amount for name, amount in req.capacity.items()}
        amounts, _ = consumption(device.capacities, requests)
        if amounts:
            out["consumedCapacity"] = consumed_text(device.capacities, amounts)
    return out


def _configs(claim: ClaimRequests, chosen: dict[int, Req]) -> list[dict[str, Any]]:
    tops = [spec.name for spec in claim.requests]
    by_class: dict[str, list[str]] = {}
    class_objs: dict[str, Any] = {}
    for ri in range(len(claim.requests)):
        req = chosen[ri]
        by_class.setdefault(req.class_name, []).append(req.name)
        class_objs[req.class_name] = req.class_obj
    out: list[dict[str, Any]] = []
    for class_name, names in by_class.items():
        for entry in (class_objs[class_name].get("spec") or {}).get("config") or []:
            if entry.get("opaque"):
                out.append({"source": "FromClass", "requests": list(names), "opaque": dict(entry["opaque"])})
    chosen_names = {req.name for req in chosen.values()} | set(tops)
    for entry in claim.configs:
        requests = [str(r) for r in entry.get("requests") or []]
        if requests and not any(r in chosen_names for r in requests):
            continue
        if entry.get("opaque"):
            out.append({"source": "FromClaim", "requests": requests, "opaque": dict(entry["opaque"])})
    for entry in out:
        covered = {r.split("/", 1)[0] for r in entry["requests"]}
        if not entry["requests"] or covered >= set(tops):
            del entry["requests"]  # applies to every request
    return out


def _node_selector(devices: list[Candidate], node: str) -> dict[str, Any] | None:
    if any(d.node_name or d.device.get("bindsToNode") for d in devices):
        return {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}
    expressions: list[dict[str, Any]] = []
    fields: list[dict[str, Any]] = []
    for d in devices:
        if d.all_nodes or not d.node_selector:
            continue
        for term in d.node_selector.get("nodeSelectorTerms") or []:
            expressions += [e for e in term.get("matchExpressions") or [] if e not in expressions]
            fields += [f for f in term.get("matchFields") or [] if f not in fields]
    if not expressions and not fields:
        return None
    merged: dict[str, Any] = {}
    if expressions:
        merged["matchExpressions"] = expressions
    if fields:
        merged["matchFields"] = fields
    return {"nodeSelectorTerms": [merged]}


def allocation_result(
    claim: ClaimRequests, chosen: dict[int, Req], picked: list[tuple[Req, Candidate]], node: str
) -> dict[str, Any]:
    """The claim's `status.allocation`."""
    allocation: dict[str, Any] = {
        "devices": {"results": [_result(req, dev) for req, dev in picked], "config": _configs(claim, chosen)}
    }
    selector = _node_selector([dev for _, dev in picked], node)
    if selector is not None:
        allocation["nodeSelector"] = selector
    return allocation
