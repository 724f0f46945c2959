"""ResourceSlices -> the pools and devices a node can use (kube-scheduler's "gather pools", reference §5.2).

Owns slice relevance (nodeName, allNodes, nodeSelector, perDeviceNodeSelection), the rule that only
a pool's newest generation counts, completeness (`resourceSliceCount` slices present, else the
pool gives nothing), validity (duplicate devices, unknown counter sets), the counter sets of both
layouts (1.34: beside the devices in one slice; 1.35+: counters-only slices of the pool), and the
counters already consumed by allocated devices. `SliceIndex` is built once per set of slices and
keeps each device's CEL environment across scheduling attempts, and what each node sees (its pools
and candidates, before allocations) across scheduling cycles: a cycle only nets the counters of
pools whose devices are allocated.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

from embedded.scheduler.capacity import Capacity, device_capacities
from embedded.scheduler.cel import DeviceEnv
from embedded.scheduler.values import QuantityError, parse_quantity

PoolKey = tuple[str, str]  # (driver, pool name)
CounterKey = tuple[str, str, str, str]  # (driver, pool, slice name or "" for pool-level, counter set)
DeviceId = tuple[str, str, str]  # (driver, pool, device)


class Candidate:
    """One device as the allocator sees it."""

    __slots__ = (
        "all_nodes",
        "capacities",
        "consumes",
        "device",
        "env",
        "id",
        "name",
        "node_name",
        "node_selector",
        "pool",
        "shareable",
        "slice_name",
        "taints",
        "text",
        "verdicts",
    )

    def __init__(
        self,
        driver: str,
        pool: str,
        slice_name: str,
        device: dict[str, Any],
        env: DeviceEnv,
        consumes: list[tuple[CounterKey, dict[str, Fraction]]],
        node_name: str,
        node_selector: dict[str, Any] | None,
        all_nodes: bool,
    ):
        self.pool = pool
        self.slice_name = slice_name
        self.device = device
        self.name = str(device.get("name", ""))
        self.id: DeviceId = (driver, pool, self.name)
        self.env = env
        self.consumes = consumes
        self.taints: list[dict[str, Any]] = list(device.get("taints") or [])
        self.node_name = node_name
        self.node_selector = node_selector
        self.all_nodes = all_nodes
        self.shareable = bool(device.get("allowMultipleAllocations", False))
        # Shareable devices only: each allocation consumes part of these (capacity.py).
        self.capacities: dict[str, Capacity] = device_capacities(device, driver) if self.shareable else {}
        self.text = f"{pool}/{self.name}" if pool != node_name else self.name
        self.verdicts: dict[str, Any] = {}  # request signature -> CEL verdict (the allocator's cache)

    @property
    def driver(self) -> str:
        return self.id[0]

    def label(self) -> str:
        return self.text


class Pool:
    """The newest generation of one (driver, pool) as visible from a node."""

    __slots__ = ("counters", "devices", "driver", "filtered", "generation", "incomplete", "invalid", "name", "plain")

    def __init__(self, driver: str, name: str, generation: int):
        self.driver = driver
        self.name = name
        self.generation = generation
        self.devices: list[Candidate] = []
        self.counters: dict[CounterKey, dict[str, Fraction]] = {}
        self.incomplete = ""
        self.invalid = ""
        # Kept pools only (see SliceIndex.gather): no counters, taints or shareable devices, so a
        # request's filtering depends on its selectors and on who holds each device; the allocator
        # keeps its results here, with the AllocatedState's stamp of the pool.
        self.plain = False
        self.filtered: dict[Any, Any] = {}

    def with_counters(self, counters: dict[CounterKey, dict[str, Fraction]]) -> Pool:
        """The same pool with other (netted) counters; devices are shared."""
        out = Pool(self.driver, self.name, self.generation)
        out.devices, out.counters, out.incomplete, out.invalid = self.devices, counters, self.incomplete, self.invalid
        return out


Consumers = list[tuple[DeviceId, list[tuple[CounterKey, dict[str, Fraction]]]]]
MAX_VIEWS = 20_000


def node_labels(node: Mapping[str, Any]) -> tuple[str, Mapping[str, str]]:
    """The node's name and labels (the node's own mapping: read it, do not change it)."""
    md = node.get("metadata") or {}
    return str(md.get("name", "")), md.get("labels") or {}


def _requirement_matches(req: Mapping[str, Any], values: Mapping[str, str]) -> bool:
    key, op, wanted = req.get("key", ""), req.get("operator", ""), list(req.get("values") or [])
    present = key in values
    value = values.get(key, "")
    if op == "In":
        return present and value in wanted
    if op == "NotIn":
        return not present or value not in wanted
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt") and present and len(wanted) == 1:
        try:
            have, limit = int(value), int(wanted[0])
        except ValueError:
            return False
        return have > limit if op == "Gt" else have < limit
    return False


def selector_matches(selector: Mapping[str, Any] | None, node: Mapping[str, Any]) -> bool:
    """core/v1 NodeSelector: any term matches when all its expressions and fields do."""
    if not selector:
        return False
    name, labels = node_labels(node)
    fields = {"metadata.name": name}
    for term in selector.get("nodeSelectorTerms") or []:
        exprs = term.get("matchExpressions") or []
        flds = term.get("matchFields") or []
        if not exprs and not flds:
            continue
        if all(_requirement_matches(r, labels) for r in exprs) and all(_requirement_matches(r, fields) for r in flds):
            return True
    return False


def _device_visible(device: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    name, _ = node_labels(node)
    if device.get("nodeName"):
        return bool(device["nodeName"] == name)
    if device.get("allNodes"):
        return True
    return selector_matches(device.get("nodeSelector"), node)


def _exact(q: Fraction) -> Fraction | int:
    return q.numerator if q.denominator == 1 else q  # ints keep counter arithmetic fast


def _quantities(counters: Mapping[str, Any]) -> dict[str, Fraction]:
    return {name: _exact(parse_quantity(str(c.get("value", "0")))) for name, c in (counters or {}).items()}  # type: ignore[misc]


class _PoolSlices:
    """Every slice of one pool at its newest generation (all nodes)."""

    __slots__ = ("declared", "generation", "slices")

    def __init__(self) -> None:
        self.generation = -1
        self.declared = 0
        self.slices: list[dict[str, Any]] = []


class SliceIndex:
    """All ResourceSlices, indexed for per-node gathering; device CEL environments are kept here."""

    def __init__(self, slices: Iterable[Mapping[str, Any]], previous: SliceIndex | None = None):
        self.pools: dict[PoolKey, _PoolSlices] = defaultdict(_PoolSlices)
        self.by_node: dict[str, set[PoolKey]] = defaultdict(set)
        self.anywhere: set[PoolKey] = set()  # pools with allNodes / nodeSelector / per-device slices
        self.envs: dict[tuple[str, str, str, str], tuple[dict[str, Any], DeviceEnv]] = {}
        for s in slices:
            spec = s.get("spec") or {}
            pool = spec.get("pool") or {}
            key = (str(spec.get("driver", "")), str(pool.get("name", "")))
            gen = int(pool.get("generation", 0))
            entry = self.pools[key]
            if gen > entry.generation:
                entry.generation, entry.slices = gen, []
            if gen == entry.generation:
                entry.slices.append(dict(s))
                entry.declared = int(pool.get("resourceSliceCount", 1))
            if spec.get("nodeName"):
                self.by_node[str(spec["nodeName"])].add(key)
            elif spec.get("allNodes") or spec.get("nodeSelector") or spec.get("perDeviceNodeSelection"):
                self.anywhere.add(key)
        for entry in self.pools.values():
            entry.slices.sort(key=lambda sl: str((sl.get("metadata") or {}).get("name", "")))
        self._old_envs = previous.envs if previous is not None else {}
        self._all_envs: list[DeviceEnv] | None = None
        # node name (with its labels when selector pools exist) -> its pools before allocations, and
        # per pool the devices consuming its counters
        self._views: dict[Any, tuple[list[Pool], list[Consumers]]] = {}

    def slice_count(self) -> int:
        return sum(len(p.slices) for p in self.pools.values())

    def device_envs(self) -> list[DeviceEnv]:
        """The CEL environment of every device of every pool's newest generation (the ones `gather` uses)."""
        if self._all_envs is None:
            self._all_envs = []
            for (driver, pool), entry in self.pools.items():
                for sl in entry.slices:
                    sname = str((sl.get("metadata") or {}).get("name", ""))
                    for device in (sl.get("spec") or {}).get("devices") or []:
                        self._all_envs.append(self._env(driver, pool, sname, device))
        return self._all_envs

    def gather(self, node: Mapping[str, Any], allocated: Mapping[DeviceId, Any]) -> list[Pool]:
        """The pools visible from `node`, sorted by (driver, pool), with counters net of `allocated`.

        The pools (and, when no counters are consumed, the list itself) are shared between calls:
        treat them as read-only. A pool whose counters are consumed by allocated devices comes as a
        copy with netted counters."""
        name, labels = node_labels(node)
        key: Any = (name, tuple(sorted(labels.items()))) if self.anywhere else name
        view = self._views.get(key)
        if view is None:
            view = self._view(node)
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            self._views[key] = view
        pools, consumers = view
        if not consumers:
            return pools
        out: list[Pool] = []
        for pool, users in zip(pools, consumers, strict=True):
            if users and any(did in allocated for did, _ in users):
                counters = {ckey: dict(amounts) for ckey, amounts in pool.counters.items()}
                for did, consumes in users:
                    if did in allocated:
                        for ckey, amounts in consumes:
                            have = counters[ckey]
                            for cname, amount in amounts.items():
                                have[cname] = have.get(cname, Fraction(0)) - amount
                pool = pool.with_counters(counters)
            out.append(pool)
        return out

    def _view(self, node: Mapping[str, Any]) -> tuple[list[Pool], list[Consumers]]:
        """The node's pools before allocations, and per pool the devices that consume its counters
        (an empty list of those when no pool has any)."""
        name, _ = node_labels(node)
        keys = sorted(self.by_node.get(name, set()) | self.anywhere)
        pools: list[Pool] = []
        consumers: list[Consumers] = []
        for key in keys:
            entry = self.pools[key]
            relevant = [sl for sl in entry.slices if self._relevant(sl, node)]
            if not relevant:
                continue
            pool = Pool(key[0], key[1], entry.generation)
            if len(entry.slices) != entry.declared:
                pool.incomplete = (
                    f"pool {key[1]} of {key[0]} is incomplete: {len(entry.slices)} of "
                    f"{entry.declared} slices of generation {entry.generation} are published"
                )
            users: Consumers = []
            self._fill(pool, entry, relevant, node, users)
            pool.plain = not pool.counters and not any(d.taints or d.shareable for d in pool.devices)
            pools.append(pool)
            consumers.append(users)
        return pools, (consumers if any(consumers) else [])

    @staticmethod
    def _relevant(sl: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
        spec = sl.get("spec") or {}
        name, _ = node_labels(node)
        if spec.get("nodeName"):
            return bool(spec["nodeName"] == name)
        if spec.get("allNodes"):
            return True
        if spec.get("nodeSelector"):
            return selector_matches(spec["nodeSelector"], node)
        if spec.get("perDeviceNodeSelection"):
            return any(_device_visible(d, node) for d in spec.get("devices") or [])
        return False

    def _fill(
        self,
        pool: Pool,
        entry: _PoolSlices,
        relevant: list[dict[str, Any]],
        node: Mapping[str, Any],
        consumers: Consumers,
    ) -> None:
        driver = pool.driver
        names: set[str] = set()
        pool_sets: set[str] = set()
        try:
            for sl in entry.slices:  # counters come from every slice of the pool, relevant or not
                spec = sl.get("spec") or {}
                sname = str((sl.get("metadata") or {}).get("name", ""))
                has_devices = bool(spec.get("devices"))
                for cs in spec.get("sharedCounters") or []:
                    scope = sname if has_devices else ""
                    ckey = (driver, pool.name, scope, str(cs.get("name", "")))
                    if ckey in pool.counters:
                        pool.invalid = f"pool {pool.name} of {driver} has counter set {ckey[3]} twice"
                    pool.counters[ckey] = _quantities(cs.get("counters") or {})
                    if not scope:
                        pool_sets.add(ckey[3])
            relevant_ids = {id(sl) for sl in relevant}
            for sl in entry.slices:
                spec = sl.get("spec") or {}
                sname = str((sl.get("metadata") or {}).get("name", ""))
                own_sets = {str(cs.get("name", "")) for cs in spec.get("sharedCounters") or []}
                per_device = bool(spec.get("perDeviceNodeSelection"))
                for device in spec.get("devices") or []:
                    dname = str(device.get("name", ""))
                    if dname in names:
                        pool.invalid = f"pool {pool.name} of {driver} has device {dname} twice"
                    names.add(dname)
                    consumes = self._consumption(pool, sname, own_sets, pool_sets, device)
                    did = (driver, pool.name, dname)
                    if consumes:  # a shareable device's counters: consumed once while any share is allocated
                        consumers.append((did, consumes))
                    if id(sl) not in relevant_ids or (per_device and not _device_visible(device, node)):
                        continue
                    env = self._env(driver, pool.name, sname, device)
                    node_sel = device.get("nodeSelector") if per_device else spec.get("nodeSelector")
                    node_name = str(device.get("nodeName") or "") if per_device else str(spec.get("nodeName") or "")
                    all_nodes = bool(device.get("allNodes") if per_device else spec.get("allNodes"))
                    pool.devices.append(
                        Candidate(driver, pool.name, sname, device, env, consumes, node_name, node_sel, all_nodes)
                    )
        except (QuantityError, KeyError, TypeError, ValueError) as exc:
            pool.invalid = pool.invalid or f"pool {pool.name} of {driver} is invalid: {exc}"

    def _env(self, driver: str, pool: str, sname: str, device: dict[str, Any]) -> DeviceEnv:
        """The device's CEL environment, reused while the device is unchanged (selector results too)."""
        ekey = (driver, pool, sname, str(device.get("name", "")))
        found = self.envs.get(ekey) or self._old_envs.get(ekey)
        if found is None or not (found[0] is device or found[0] == device):
            found = (device, DeviceEnv(driver, device))
        self.envs[ekey] = found
        return found[1]

    @staticmethod
    def _consumption(
        pool: Pool, sname: str, own_sets: set[str], pool_sets: set[str], device: Mapping[str, Any]
    ) -> list[tuple[CounterKey, dict[str, Fraction]]]:
        out: list[tuple[CounterKey, dict[str, Fraction]]] = []
        for use in device.get("consumesCounters") or []:
            set_name = str(use.get("counterSet", ""))
            if set_name in own_sets:
                ckey = (pool.driver, pool.name, sname, set_name)
            elif set_name in pool_sets:
                ckey = (pool.driver, pool.name, "", set_name)
            else:
                raise ValueError(f"device {device.get('name')} consumes unknown counter set {set_name}")
            amounts = _quantities(use.get("counters") or {})
            unknown = set(amounts) - set(pool.counters[ckey])
            if unknown:
                raise ValueError(
                    f"device {device.get('name')} consumes unknown counters "
                    f"{', '.join(sorted(unknown))} of set {set_name}"
                )
            out.append((ckey, amounts))
        return out
