"""What the dashboard keeps of each API object: the Informer transforms (state.py) that cut ResourceSlices,
ResourceClaims, Nodes and ComputeDomains down to the fields the rows (model.py) read, so 1,000 nodes' slices stay
small in memory."""

from __future__ import annotations

from services.dashboard.model import CLIQUE_ATTRIBUTE, Obj, domain_members

_META = ("name", "namespace", "uid", "resourceVersion", "deletionTimestamp", "creationTimestamp", "ownerReferences")
SHARE_CAPACITIES = ("memory", "compute", "shares")  # what shares of a GPU consume (services/publisher/shares.py)
_DEVICE_ATTRIBUTES = (
    "type",
    "uuid",
    "productName",
    "parentUUID",
    "profile",
    CLIQUE_ATTRIBUTE,
    "nvlinkClusterUUID",
    "nvlinkCliqueID",
)


def _meta(obj: Obj, annotations: tuple[str, ...] = ()) -> Obj:
    md = obj.get("metadata") or {}
    out = {k: md[k] for k in _META if k in md}
    kept = {k: v for k, v in (md.get("annotations") or {}).items() if k in annotations}
    if kept:
        out["annotations"] = kept
    return out


def _trim_device(dev: Obj) -> Obj:
    attrs = dev.get("attributes") or {}
    out: Obj = {"name": dev.get("name", ""), "attributes": {k: attrs[k] for k in _DEVICE_ATTRIBUTES if k in attrs}}
    capacity = {
        k: v for k, v in (dev.get("capacity") or {}).items() if k in SHARE_CAPACITIES or k.startswith("memorySlice")
    }
    if capacity:
        out["capacity"] = capacity
    if dev.get("allowMultipleAllocations"):
        out["allowMultipleAllocations"] = True
    uses = [
        {
            "counterSet": u.get("counterSet", ""),
            "counters": {k: v for k, v in (u.get("counters") or {}).items() if k.startswith("memory-slice-")},
        }
        for u in dev.get("consumesCounters") or []
    ]
    if uses:
        out["consumesCounters"] = uses
    if dev.get("taints"):
        out["taints"] = dev["taints"]
    return out


def trim_slice(rslice: Obj) -> Obj:
    spec = rslice.get("spec") or {}
    return {
        "metadata": _meta(rslice),
        "spec": {
            "driver": spec.get("driver", ""),
            "nodeName": spec.get("nodeName", ""),
            "pool": {"name": (spec.get("pool") or {}).get("name", "")},
            "devices": [_trim_device(d) for d in spec.get("devices") or []],
        },
    }


def trim_claim(claim: Obj, annotations: tuple[str, ...] = ()) -> Obj:
    status = claim.get("status") or {}
    devices = (status.get("allocation") or {}).get("devices") or {}
    out: Obj = {"metadata": _meta(claim, annotations), "status": {}}
    if status.get("allocation"):
        out["status"]["allocation"] = {
            "devices": {
                "results": [
                    {k: r[k] for k in ("request", "driver", "pool", "device", "shareID", "consumedCapacity") if k in r}
                    for r in devices.get("results") or []
                ],
                "config": devices.get("config") or [],
            }
        }
    if status.get("reservedFor"):
        out["status"]["reservedFor"] = [
            {k: r[k] for k in ("resource", "name", "uid") if k in r} for r in status["reservedFor"]
        ]
    return out


def trim_node(node: Obj) -> Obj:
    conditions = [c for c in ((node.get("status") or {}).get("conditions") or []) if c.get("type") == "Ready"]
    return {"metadata": _meta(node), "status": {"conditions": conditions}}


def trim_domain(domain: Obj) -> Obj:
    return {"metadata": _meta(domain), "status": {"nodes": [{"name": name} for name in domain_members(domain)]}}
