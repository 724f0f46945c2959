"""The fleet as the page shows it: pure functions from API objects (and bus facts) to node rows.

One job: turn ResourceSlices, ResourceClaims, Nodes, ComputeDomains and device health into the
contract's rows (docs/dashboard.md, "The API"). Every function is pure and works on ONE node's facts,
so the state (state.py) rebuilds only the rows a change touches; the bench and the tests call the
same functions. Rows are msgspec Structs that encode to the contract's camelCase JSON.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import msgspec

from shared.claimconfigs import (
    ClaimConfigError,
    GpuConfig,
    RawConfig,
    interval,
    select,
)
from shared.devicemodel import GPU_DRIVER, parse_mig_name
from shared.numbers import decimal_int

Obj = dict[str, Any]
DeviceType = Literal["gpu", "mig", "partition"]
State = Literal["free", "claimed", "tainted"]
STATES: tuple[State, ...] = ("free", "claimed", "tainted")
CD_DRIVER = "compute-domain.nvidia.com"
CLIQUE_ATTRIBUTE = "cliqueID"  # on the compute-domain pool's devices: <clusterUUID>.<cliqueId>
XID_TAINT = "gpu.nvidia.com/xid"
DEFAULT_MIG_SLOTS = 8  # memory slices of a MIG-capable GPU when no counter set says (A100/H100: 8)
UNGROUPED = "ungrouped"


class _Camel(msgspec.Struct, rename="camel", kw_only=True):
    pass


class Sharing(_Camel):
    mode: Literal["exclusive", "time-slicing", "mps"] = "exclusive"
    interval: str = ""
    thread_percentage: int | None = None
    pinned_memory: str = ""


class Share(_Camel):
    """What a share of a device (KEP-5075 consumable capacity: an allocation result with a shareID) takes of
    it; for a viewer who may not see the claim's namespace, without its id."""

    id: str = ""
    memory_bytes: int = 0
    compute: int | None = None  # percent of the device's SMs
    shares: int | None = None  # a count, of the device's N


class Capacity(_Camel):
    """What a shared device has left for more shares: its capacity less what its shares consume (None: the
    device does not offer that capacity)."""

    memory_bytes: int | None = None
    compute: int | None = None
    shares: int | None = None


class Allocation(_Camel):
    namespace: str
    claim: str
    claim_uid: str = ""
    pods: list[str] = msgspec.field(default_factory=list)
    since: str = ""
    sharing: Sharing = msgspec.field(default_factory=Sharing)
    other_tenant: bool = False  # a namespace the viewer may not see: no names
    share: Share | None = None  # a share of the device, not all of it


class Taint(_Camel):
    key: str
    value: str = ""
    effect: str = ""
    time_added: str = ""


class MigPlacement(_Camel):
    profile: str
    start: int
    size: int


class Device(_Camel):
    name: str
    uuid: str = ""
    product: str = ""
    memory_bytes: int = 0
    type: DeviceType = "gpu"
    parent: str = ""
    mig: MigPlacement | None = None
    mig_slots: int = 0
    taints: list[Taint] = msgspec.field(default_factory=list)
    xid: int | None = None
    state: State = "free"
    allocations: list[Allocation] = msgspec.field(default_factory=list)
    shared: bool = False  # offered in shares (allowMultipleAllocations)
    capacity_left: Capacity | None = None  # a shared device: what more shares may take


class Node(_Camel):
    name: str
    pool: str = ""
    clique: str = ""
    domains: list[str] = msgspec.field(default_factory=list)
    ready: bool = False
    devices: list[Device] = msgspec.field(default_factory=list)


class Group(_Camel):
    name: str
    nodes: list[str]


class Health(msgspec.Struct, frozen=True):
    """The last live health fact of a device from the bus (faster than the slice's taint)."""

    unhealthy: bool
    xid: int = 0
    reason: str = ""
    time: str = ""


# ---- reading API objects --------------------------------------------------------------------------


def attr(device: Obj, key: str) -> str:
    value = (device.get("attributes") or {}).get(key) or {}
    for kind in ("string", "version", "int", "bool"):
        if kind in value:
            return str(value[kind])
    return ""


_SUFFIX = {
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def quantity_bytes(text: str) -> int:
    """`80Gi` -> bytes; 0 for what is not a plain quantity (the page shows no memory then)."""
    text = str(text or "").strip()
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if text.endswith(suffix) and (count := decimal_int(text[: -len(suffix)])) is not None:
            return count * _SUFFIX[suffix]
    return decimal_int(text) or 0


def _slots(dev: Obj) -> list[int]:
    """The memory slices a device covers: static MIG capacity `memorySlice<i>`, or dynamic counters
    `memory-slice-<i>` it consumes."""
    found = [
        i
        for k in (dev.get("capacity") or {})
        if k.startswith("memorySlice") and (i := decimal_int(k[len("memorySlice") :])) is not None
    ]
    for use in dev.get("consumesCounters") or []:
        found += [
            i
            for k in (use.get("counters") or {})
            if k.startswith("memory-slice-") and (i := decimal_int(k[len("memory-slice-") :])) is not None
        ]
    return sorted(set(found))


def _taints(dev: Obj) -> list[Taint]:
    return [
        Taint(
            key=str(t.get("key") or ""),
            value=str(t.get("value") or ""),
            effect=str(t.get("effect") or ""),
            time_added=str(t.get("timeAdded") or ""),
        )
        for t in dev.get("taints") or []
    ]


def slice_node(rslice: Obj) -> str:
    spec = rslice.get("spec") or {}
    return str(spec.get("nodeName") or (spec.get("pool") or {}).get("name") or "")


def node_ready(node: Obj | None) -> bool:
    conditions = ((node or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def domain_members(domain: Obj) -> list[str]:
    """The node names a ComputeDomain's status lists."""
    return [str(n.get("name")) for n in ((domain.get("status") or {}).get("nodes") or []) if n.get("name")]


def domain_name(domain: Obj) -> str:
    md = domain.get("metadata") or {}
    return f"{md.get('namespace', '')}/{md.get('name', '')}"


# ---- claims -> allocations ------------------------------------------------------------------------

DeviceKey = tuple[str, str, str]  # (driver, pool, device)


def claim_results(claim: Obj) -> list[Obj]:
    return list((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or [])


def claim_devices(claim: Obj) -> list[DeviceKey]:
    return [
        (str(r.get("driver") or ""), str(r.get("pool") or ""), str(r.get("device") or "")) for r in claim_results(claim)
    ]


def claim_pods(claim: Obj) -> list[str]:
    ns = (claim.get("metadata") or {}).get("namespace", "")
    return [
        f"{ns}/{r.get('name')}"
        for r in (claim.get("status") or {}).get("reservedFor") or []
        if r.get("resource", "pods") == "pods"
    ]


def _sharing(config: Any) -> Sharing:
    sharing = getattr(config, "sharing", None)
    if sharing is None:
        return Sharing()
    if sharing.strategy == "TimeSlicing":
        return Sharing(mode="time-slicing", interval=interval(config) if isinstance(config, GpuConfig) else "Default")
    mps = sharing.mpsConfig
    return Sharing(
        mode="mps",
        thread_percentage=mps.defaultActiveThreadPercentage if mps else None,
        pinned_memory=(mps.defaultPinnedDeviceMemoryLimit or "") if mps else "",
    )


def claim_sharing(claim: Obj) -> dict[int, Sharing]:
    """Result index -> how that device is shared, from the claim's opaque GpuConfig/MigDeviceConfig (as the
    preparer reads them); a config the preparer would refuse shows as exclusive."""
    allocation = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
    raw = [
        RawConfig(
            source=str(c.get("source") or "FromClaim"),
            requests=list(c.get("requests") or []),
            driver=str((c.get("opaque") or {}).get("driver") or ""),
            parameters=(c.get("opaque") or {}).get("parameters"),
            has_opaque=c.get("opaque") is not None,
        )
        for c in allocation.get("config") or []
    ]
    results = allocation.get("results") or []
    ours = [(i, r) for i, r in enumerate(results) if r.get("driver") == GPU_DRIVER]
    if not raw or not ours:
        return {}
    kinds = [
        (str(r.get("request") or ""), "mig" if parse_mig_name(str(r.get("device") or "")) else "gpu") for _, r in ours
    ]
    try:
        chosen = select(GPU_DRIVER, raw, kinds)
    except ClaimConfigError:
        return {}
    out: dict[int, Sharing] = {}
    for group in chosen:
        for index in group.results:
            out[ours[index][0]] = _sharing(group.config)
    return out


def _count(text: Any) -> int | None:
    return decimal_int(str(text if text is not None else "").strip())


def result_share(result: Obj) -> Share | None:
    """The share an allocation result holds (its shareID and consumedCapacity); None for a whole device."""
    if not result.get("shareID"):
        return None
    consumed = result.get("consumedCapacity") or {}
    return Share(
        id=str(result["shareID"]),
        memory_bytes=quantity_bytes(consumed.get("memory", "")),
        compute=_count(consumed.get("compute")),
        shares=_count(consumed.get("shares")),
    )


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None and b is None else (a or 0) + (b or 0)


def allocations_of(claim: Obj, since: str = "") -> dict[DeviceKey, Allocation]:
    """The Allocation a claim puts on each device it holds (two shares of one device: one, summed)."""
    md = claim.get("metadata") or {}
    sharing = claim_sharing(claim)
    pods = claim_pods(claim)
    out: dict[DeviceKey, Allocation] = {}
    for index, (key, result) in enumerate(zip(claim_devices(claim), claim_results(claim), strict=True)):
        share = result_share(result)
        held = out.get(key)
        if held is not None and held.share is not None and share is not None:
            held.share = Share(
                id=held.share.id,
                memory_bytes=held.share.memory_bytes + share.memory_bytes,
                compute=_add(held.share.compute, share.compute),
                shares=_add(held.share.shares, share.shares),
            )
            continue
        out[key] = Allocation(
            namespace=str(md.get("namespace") or ""),
            claim=str(md.get("name") or ""),
            claim_uid=str(md.get("uid") or ""),
            pods=pods,
            since=since or str(md.get("creationTimestamp") or ""),
            sharing=sharing.get(index, Sharing()),
            share=share,
        )
    return out


def capacity_left(dev: Obj, allocations: Iterable[Allocation]) -> Capacity | None:
    """A device offered in shares: its capacities (memory, compute, shares) less what its shares consume
    (never below 0); None for a device not offered in shares."""
    if not dev.get("allowMultipleAllocations"):
        return None
    capacity = dev.get("capacity") or {}

    def total(name: str) -> int | None:
        value = (capacity.get(name) or {}).get("value")
        if value is None:
            return None
        return quantity_bytes(value) if name == "memory" else _count(value)

    shares = [a.share for a in allocations if a.share is not None]
    memory, compute, count = total("memory"), total("compute"), total("shares")
    return Capacity(
        memory_bytes=None if memory is None else max(0, memory - sum(s.memory_bytes for s in shares)),
        compute=None if compute is None else max(0, compute - sum(s.compute or 0 for s in shares)),
        shares=None if count is None else max(0, count - sum(s.shares or 0 for s in shares)),
    )


# ---- one node's row --------------------------------------------------------------------------------


def _device(
    dev: Obj, pool: str, allocations: Mapping[DeviceKey, list[Allocation]], health: Mapping[str, Health]
) -> Device:
    name = str(dev.get("name") or "")
    kind = attr(dev, "type") or "gpu"
    slots = _slots(dev)
    parsed = parse_mig_name(name)
    mig = None
    parent = ""
    dtype: DeviceType = "gpu"
    mig_slots = 0
    if kind == "mig" or parsed:
        dtype = "mig" if attr(dev, "uuid") else "partition"  # a dynamic placement has no UUID until created
        parent = f"gpu-{parsed[0]}" if parsed else ""
        start = parsed[3] if parsed else (slots[0] if slots else 0)
        mig = MigPlacement(profile=attr(dev, "profile"), start=slots[0] if slots else start, size=len(slots) or 1)
    elif slots:
        mig_slots = len(slots)  # a partitionable full GPU consumes every memory slice of its counter set
    memory = quantity_bytes(((dev.get("capacity") or {}).get("memory") or {}).get("value", ""))
    taints = _taints(dev)
    xid = next((x for t in taints if t.key == XID_TAINT and (x := decimal_int(t.value)) is not None), None)
    live = health.get(name) or (health.get(parent) if parent else None)
    if xid is None and live is not None and live.unhealthy and live.xid:
        xid = live.xid
    allocs = list(allocations.get((GPU_DRIVER, pool, name), ()))
    state: State = "tainted" if taints or (live is not None and live.unhealthy) else ("claimed" if allocs else "free")
    return Device(
        name=name,
        uuid=attr(dev, "uuid"),
        product=attr(dev, "productName"),
        memory_bytes=memory,
        type=dtype,
        parent=parent,
        mig=mig,
        mig_slots=mig_slots,
        taints=taints,
        xid=xid,
        state=state,
        allocations=allocs,
        shared=bool(dev.get("allowMultipleAllocations")),
        capacity_left=capacity_left(dev, allocs),
    )


def node_row(
    name: str,
    slices: Iterable[Obj],
    node: Obj | None,
    allocations: Mapping[DeviceKey, list[Allocation]],
    health: Mapping[str, Health],
    domains: Iterable[str] = (),
) -> Node:
    """The row of node `name` from its ResourceSlices (both drivers), its Node, the allocations on its
    devices, its devices' live health and the ComputeDomains that list it."""
    slices = list(slices)
    devices: list[Device] = []
    pool, clique = "", ""
    for rslice in slices:
        spec = rslice.get("spec") or {}
        driver = spec.get("driver")
        if driver == CD_DRIVER:
            clique = clique or next(
                (attr(d, CLIQUE_ATTRIBUTE) for d in spec.get("devices") or [] if attr(d, CLIQUE_ATTRIBUTE)), ""
            )
            continue
        if driver != GPU_DRIVER:
            continue
        pool = str((spec.get("pool") or {}).get("name") or name)
        devices += [_device(d, pool, allocations, health) for d in spec.get("devices") or []]
    clique = clique or gpu_clique(slices)
    devices = _with_parents(devices)
    devices.sort(key=_device_order)
    return Node(
        name=name,
        pool=pool or name,
        clique=clique,
        domains=sorted(set(domains)),
        ready=node_ready(node),
        devices=devices,
    )


def gpu_clique(slices: Iterable[Obj]) -> str:
    """The NVLink clique from the GPU attributes, for a node without a compute-domain pool."""
    for rslice in slices:
        for dev in (rslice.get("spec") or {}).get("devices") or []:
            cluster, clique = attr(dev, "nvlinkClusterUUID"), attr(dev, "nvlinkCliqueID")
            if cluster and clique:
                return f"{cluster}.{clique}"
    return ""


def _with_parents(devices: list[Device]) -> list[Device]:
    """MIG devices of a GPU that is not itself advertised (static MIG mode) get a parent tile to be drawn
    in: type gpu, the GPU's UUID and product, migSlots from its placements."""
    names = {d.name for d in devices}
    parents: dict[str, Device] = {}
    for d in devices:
        if d.mig is None or not d.parent:
            continue
        if d.parent in names:
            continue
        parent = parents.setdefault(d.parent, Device(name=d.parent, product=d.product, type="gpu"))
        parent.mig_slots = max(parent.mig_slots, d.mig.start + d.mig.size, DEFAULT_MIG_SLOTS)
    for d in devices:  # an advertised MIG-capable GPU without counters (static mode, MIG off)
        if d.mig is not None and d.parent in names:
            full = next(p for p in devices if p.name == d.parent)
            full.mig_slots = full.mig_slots or max(d.mig.start + d.mig.size, DEFAULT_MIG_SLOTS)
    return devices + list(parents.values())


def _device_order(d: Device) -> tuple[int, int, int, str]:
    parsed = parse_mig_name(d.name)
    if parsed:
        return (parsed[0], 1, parsed[3], d.name)
    minor = decimal_int(d.name.removeprefix("gpu-"))
    return (1 << 20 if minor is None else minor, 0, 0, d.name)


def group_name(node: Node) -> str:
    """A node's group: its first ComputeDomain, else its NVLink clique, else ungrouped."""
    if node.domains:
        return f"domain {node.domains[0]}"
    if node.clique:
        return f"clique {node.clique}"
    return UNGROUPED


def groups(nodes: Iterable[Node]) -> list[Group]:
    """Groups in order (domains, cliques, ungrouped last), node names sorted within each."""
    by: dict[str, list[str]] = {}
    for node in nodes:
        by.setdefault(group_name(node), []).append(node.name)
    order = sorted(by, key=lambda g: (g == UNGROUPED, not g.startswith("domain "), g))
    return [Group(name=g, nodes=sorted(by[g])) for g in order]


def node_counters(node: Node) -> dict[str, dict[str, int]]:
    """Device counts of one row by product, then state (parent tiles drawn for MIG devices not counted)."""
    out: dict[str, dict[str, int]] = {}
    for device in node.devices:
        if device.type == "partition" and device.state == "free":
            continue  # a placement not created: it is the free part of its GPU, counted there
        if device.type == "gpu" and not device.uuid and device.mig_slots:
            continue  # the drawn parent of static MIG devices
        by_state = out.setdefault(device.product or "unknown", dict.fromkeys(STATES, 0))
        by_state[device.state] += 1
    return out


def add_counters(total: dict[str, dict[str, int]], part: Mapping[str, Mapping[str, int]], sign: int = 1) -> None:
    for product, states in part.items():
        into = total.setdefault(product, dict.fromkeys(STATES, 0))
        for state, n in states.items():
            into[state] += sign * n
        if not any(into.values()):
            del total[product]


def counters(fleet: Iterable[Node]) -> dict[str, dict[str, int]]:
    """Device counts by product, then by state, over rows."""
    total: dict[str, dict[str, int]] = {}
    for node in fleet:
        add_counters(total, node_counters(node))
    return total


_CLAIM_KEY = re.compile(r"\bclaim ([a-z0-9][-a-z0-9]*)/[-a-z0-9.]+")


def redact_text(text: str, visible: frozenset[str] | None) -> str:
    """`gpu-dra explain`'s text as a viewer allowed `visible` namespaces sees it (None: all): another tenant's
    claim (`claim ns/name`, e.g. the holder of a device the pod cannot have) loses its name."""
    if visible is None:
        return text
    return _CLAIM_KEY.sub(lambda m: m.group(0) if m.group(1) in visible else "another tenant's claim", text)


def redact(node: Node, visible: frozenset[str] | None) -> Node:
    """The row as a viewer allowed `visible` namespaces sees it (None: all): other tenants' allocations stay,
    as `otherTenant` without names, pods, claim UID or share id (a share keeps what it consumes, so the
    device's capacity left adds up)."""
    if visible is None or not any(a.namespace not in visible for d in node.devices for a in d.allocations):
        return node
    devices = [
        d
        if all(a.namespace in visible for a in d.allocations)
        else msgspec.structs.replace(
            d,
            allocations=[
                a
                if a.namespace in visible
                else Allocation(
                    namespace="",
                    claim="",
                    since=a.since,
                    sharing=a.sharing,
                    other_tenant=True,
                    share=None if a.share is None else msgspec.structs.replace(a.share, id=""),
                )
                for a in d.allocations
            ],
        )
        for d in node.devices
    ]
    return msgspec.structs.replace(node, devices=devices)
