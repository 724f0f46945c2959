"""The dashboard's one view of the fleet: ONE watch set and the bus, feeding the model; viewers get deltas.

Owns the informers (ResourceSlices, ResourceClaims, Nodes and, when served, ComputeDomains; several
`shared.kube.informer.Informer`s on one Kube client), the claim lifecycle events (an ordered consumer that
replays the last day into `gpuhours.GpuHours` and goes on live), the core NATS subscriptions to device health
and utilisation telemetry (`utilisation.TelemetryStore`), the indexes that say which node rows a change
touches, the rows themselves (rebuilt one node at a time by `model.node_row`), a ring of recent events per
device, and the viewers: each keeps the names of rows changed since it last sent, and is woken at most every
`flush_s` (coalesced deltas, <= 10/s). The pods waiting for devices, and why, are `pending.PendingPods`' (its
informer runs with the others).
Nothing here asks the API per viewer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

from services.computedomain import crd
from services.dashboard import model, trim
from services.dashboard.gpuhours import CLOSES, GpuHours
from services.dashboard.model import Allocation, DeviceKey, Health, Node
from services.dashboard.pending import PendingPods, Reasoner
from services.dashboard.utilisation import TelemetryStore
from shared.bus import Bus, MsgContext
from shared.devicemodel import GPU_DRIVER
from shared.events.catalog import CLAIM, HEALTH, TELEMETRY
from shared.events.claims import ClaimLifecycle
from shared.events.health import DeviceHealth
from shared.events.telemetry import NodeTelemetry
from shared.kube.informer import Informer, key_of, uid_of, until_synced
from shared.kube.resources import NODES, PODS, RESOURCECLAIMS, RESOURCESLICES, Kube, Resource
from shared.kube.rest import ApiError
from shared.kube.timestamps import k8s_time
from shared.kube.versions import best_version, served_versions
from shared.logs import get_logger
from shared.tasks import cancel_and_wait
from shared.telemetry import CLAIM_TRACEPARENT_ANNOTATION

log = get_logger(__name__)
Obj = dict[str, Any]
Key = tuple[str, str]
RING = 50  # events kept per device
COMPUTEDOMAINS = Resource(crd.GROUP, crd.VERSION, crd.PLURAL, crd.KIND)


class DeviceEvent(msgspec.Struct, frozen=True):
    """One entry of a device's history; `namespace` says whose it is ("" for health)."""

    time: str
    type: str
    summary: str
    namespace: str = ""


class Viewer:
    """One stream: the rows changed since its last send, and a wake-up."""

    def __init__(self) -> None:
        self.changed: set[str] = set()
        self.pending = False  # the waiting pods changed
        self.telemetry: set[str] = set()  # nodes with new utilisation samples
        self.wake = asyncio.Event()

    def take(self) -> tuple[set[str], bool]:
        """(rows changed, whether the waiting pods changed) since the last take."""
        names, self.changed = self.changed, set()
        pending, self.pending = self.pending, False
        self.wake.clear()
        return names, pending

    def take_telemetry(self) -> set[str]:
        """The nodes with new utilisation samples since the last take (call before `take`)."""
        nodes, self.telemetry = self.telemetry, set()
        return nodes


class _Allocations(Mapping[DeviceKey, list[Allocation]]):
    """device -> its allocations, the view `model.node_row` reads."""

    def __init__(self, by_device: dict[DeviceKey, dict[Key, Allocation]]) -> None:
        self._by = by_device

    def __getitem__(self, key: DeviceKey) -> list[Allocation]:
        return list(self._by[key].values())

    def __iter__(self) -> Iterator[DeviceKey]:
        return iter(self._by)

    def __len__(self) -> int:
        return len(self._by)


async def resource_resources(api_client: Any) -> tuple[Resource, Resource]:
    """ResourceSlices and ResourceClaims in the version the server serves (v1 preferred)."""
    version = best_version(await served_versions(api_client)) or "v1"
    return (dataclasses.replace(RESOURCESLICES, version=version), dataclasses.replace(RESOURCECLAIMS, version=version))


async def serves_compute_domains(api_client: Any) -> bool:
    return crd.VERSION in await served_versions(api_client, crd.GROUP)


class FleetState:
    """The rows, their version, and what changed; fed by `run()`."""

    def __init__(
        self,
        kube: Kube | None,
        *,
        slices: Resource = RESOURCESLICES,
        claims: Resource = RESOURCECLAIMS,
        compute_domains: bool = True,
        flush_s: float = 0.1,
        reasoner: Reasoner | None = None,
    ) -> None:
        self.flush_s = flush_s
        self.version = 0
        self.generated_at = k8s_time()
        self.rows: dict[str, Node] = {}
        self.encoded: dict[str, bytes] = {}  # row -> its JSON, unfiltered (filled by the server on first use)
        self.counters: dict[str, dict[str, int]] = {}
        self.groups: list[model.Group] = []
        self.viewers: set[Viewer] = set()
        self._row_counters: dict[str, dict[str, dict[str, int]]] = {}
        self._dirty: set[str] = set()
        self._pending_dirty = False
        self._telemetry_dirty: set[str] = set()
        self.telemetry = TelemetryStore()  # 10-minute utilisation rings per device
        self.gpu_hours = GpuHours()  # per-namespace GPU-hours of the last day
        self.listed = False  # every informer has listed: rows are built from then on
        self._flush_handle: asyncio.TimerHandle | None = None
        # indexes
        self._slices_of: dict[str, set[str]] = {}  # node -> slice names
        self._pool_node: dict[str, str] = {}  # GPU pool -> node
        self._allocs: dict[DeviceKey, dict[Key, Allocation]] = {}
        self._domains_of: dict[str, set[str]] = {}  # node -> "ns/name" of the domains listing it
        self._health: dict[str, dict[str, Health]] = {}  # node -> device -> live health
        self._rings: dict[tuple[str, str], deque[DeviceEvent]] = {}
        # claim uid -> trace id (lifecycle events' traceparent), while the claim exists
        self.traces: dict[str, str] = {}
        self.informers: list[Informer] = []
        self.claim_listeners: list[Callable[[str, Obj, Obj | None], None]] = []  # e.g. allocmetrics.AllocationInfo
        self.pending: PendingPods | None = None
        self.kube = kube
        if kube is not None:
            self.slices = Informer(kube, slices, on_change=self._on_slice, transform=trim.trim_slice)
            self.claims = Informer(
                kube,
                claims,
                on_change=self._on_claim,
                transform=functools.partial(trim.trim_claim, annotations=(CLAIM_TRACEPARENT_ANNOTATION,)),
            )
            self.nodes = Informer(kube, NODES, on_change=self._on_node, transform=trim.trim_node)
            self.informers = [self.slices, self.claims, self.nodes]
            self.domains: Informer | None = None
            if compute_domains:
                self.domains = Informer(kube, COMPUTEDOMAINS, on_change=self._on_domain, transform=trim.trim_domain)
                self.informers.append(self.domains)
            self.pending = PendingPods(kube, reasoner, on_change=self._on_pending)
            self.informers.append(self.pending.informer)

    # ---- running --------------------------------------------------------------------------------------

    async def subscribe_bus(self, bus: Bus) -> None:
        """Claim lifecycle events from one ordered consumer of DRA_EVENTS that starts a GPU-hours window ago
        (the past, then live: each once), live device health and utilisation (core subscriptions)."""
        await bus.subscribe(CLAIM, self._on_claim_event, since=time.time() - self.gpu_hours.window_s)
        await bus.subscribe(HEALTH, self._on_health_event)
        await bus.subscribe(TELEMETRY, self._on_telemetry)
        bus.on_reconnect(self._forget_live_health)

    async def run(self, stopping: asyncio.Event, synced: asyncio.Event | None = None) -> None:
        """Watch until `stopping`; `synced` is set once every informer has listed."""
        tasks = [asyncio.create_task(i.run(stopping), name=f"dashboard-watch-{i.res.plural}") for i in self.informers]
        if self.pending is not None:
            tasks.append(asyncio.create_task(self.pending.run(stopping), name="dashboard-pending"))
        try:
            if await until_synced([i.synced for i in self.informers], stopping):
                self.listed = True
                self.flush()
                if synced is not None:
                    synced.set()
                log.info("fleet listed", nodes=len(self.rows))
            await stopping.wait()
        finally:
            await cancel_and_wait(tasks)
            if self._flush_handle is not None:
                self._flush_handle.cancel()

    # ---- reads ---------------------------------------------------------------------------------------

    def namespaces(self) -> list[str]:
        """Namespaces that hold claims (the page's filter choices)."""
        return sorted({ns for ns, _ in self.claims.objects}) if self.informers else []

    async def has_pod(self, namespace: str, name: str) -> bool:
        """Whether the pod exists, asked of the API server when a viewer asks (the pod informer may not have
        seen a pod created a moment ago)."""
        if self.kube is None:
            return False
        try:
            await self.kube.get(PODS, namespace, name)
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True

    def events(self, node: str, device: str) -> list[DeviceEvent]:
        """A device's recent history, newest first (at most RING)."""
        return list(reversed(self._rings.get((node, device), ())))

    def claim_trace_id(self, claim: Obj) -> str:
        md = claim.get("metadata") or {}
        parent = str((md.get("annotations") or {}).get(CLAIM_TRACEPARENT_ANNOTATION) or "")
        parts = parent.split("-")
        if len(parts) == 4 and len(parts[1]) == 32:
            return parts[1]
        return self.traces.get(str(md.get("uid") or ""), "")

    def claim_nodes(self, claim: Obj) -> list[tuple[str, str]]:
        """(node, device) of each device a claim holds."""
        return [(self._pool_node.get(pool, pool), device) for _, pool, device in model.claim_devices(claim)]

    # ---- changes -> dirty rows -----------------------------------------------------------------------

    def _mark(self, node: str) -> None:
        if not node:
            return
        self._dirty.add(node)
        self._schedule_flush()

    def _on_pending(self) -> None:
        self._pending_dirty = True
        self._schedule_flush()

    def _fleet_changed(self) -> None:
        if self.pending is not None and self.listed:
            self.pending.fleet_changed()

    def _schedule_flush(self) -> None:
        if self._flush_handle is None and self.listed:
            with contextlib.suppress(RuntimeError):  # no running loop: a synchronous caller flushes itself
                self._flush_handle = asyncio.get_running_loop().call_later(self.flush_s, self.flush)

    def _on_slice(self, event: str, obj: Obj, old: Obj | None) -> None:
        name = str((obj.get("metadata") or {}).get("name") or "")
        for before in [old] if old else []:
            node = model.slice_node(before)
            self._slices_of.get(node, set()).discard(name)
            self._mark(node)
        node = model.slice_node(obj)
        if event != "DELETED":
            self._slices_of.setdefault(node, set()).add(name)
            spec = obj.get("spec") or {}
            if spec.get("driver") == GPU_DRIVER:
                self._pool_node[str((spec.get("pool") or {}).get("name") or node)] = node
        elif not self._slices_of.get(node):
            self._slices_of.pop(node, None)
        self._mark(node)
        self._fleet_changed()

    def _on_claim(self, event: str, obj: Obj, old: Obj | None) -> None:
        for listener in self.claim_listeners:
            listener(event, obj, old)
        key = key_of(obj)
        if event == "DELETED":
            self.traces.pop(uid_of(obj), None)
        before = set(model.claim_devices(old)) if old else set()
        after = model.allocations_of(obj) if event != "DELETED" else {}
        for device in before - set(after):
            held = self._allocs.get(device)
            if held is not None:
                held.pop(key, None)
                if not held:
                    del self._allocs[device]
            self._history(device, "released", f"claim {key[0]}/{key[1]} released it", key[0])
        for device, allocation in after.items():
            held = self._allocs.setdefault(device, {})
            previous = held.get(key)
            if previous is not None:  # the age counts from when the allocation was first seen
                allocation = msgspec.structs.replace(allocation, since=previous.since)
            elif self.listed:  # allocated now (the first list can only say when the claim was made)
                allocation = msgspec.structs.replace(allocation, since=k8s_time())
                self._history(device, "allocated", f"claim {key[0]}/{key[1]} allocated it", key[0])
            if previous != allocation:
                held[key] = allocation
            self._mark(self._pool_node.get(device[1], device[1]))
        for device in before:
            self._mark(self._pool_node.get(device[1], device[1]))
        if before != set(after):
            self._fleet_changed()

    def _history(
        self, device: DeviceKey, kind: str, summary: str, namespace: str = "", when: float | None = None
    ) -> None:
        if not self.listed:
            return  # what the first list finds allocated is the present, not history
        node = self._pool_node.get(device[1], device[1])
        ring = self._rings.setdefault((node, device[2]), deque(maxlen=RING))
        ring.append(DeviceEvent(time=k8s_time(when), type=kind, summary=summary, namespace=namespace))

    def _on_node(self, event: str, obj: Obj, old: Obj | None) -> None:
        name = key_of(obj)[1]
        if name in self.rows or name in self._slices_of:
            self._mark(name)

    def _on_domain(self, event: str, obj: Obj, old: Obj | None) -> None:
        name = model.domain_name(obj)
        for node in model.domain_members(old) if old else []:
            self._domains_of.get(node, set()).discard(name)
            self._mark(node)
        if event != "DELETED":
            for node in model.domain_members(obj):
                self._domains_of.setdefault(node, set()).add(name)
                self._mark(node)

    async def _on_telemetry(self, message: NodeTelemetry, ctx: MsgContext) -> None:
        if self.telemetry.add(message):
            self._telemetry_dirty.add(message.node)
            self._schedule_flush()

    async def _on_claim_event(self, message: ClaimLifecycle, ctx: MsgContext) -> None:
        self.gpu_hours.apply(message)
        if ctx.replayed:  # the past counts in GPU-hours only: allocations are the claims', history is from now on
            return
        ns, name = message.claim_namespace, message.claim_name
        parent = ctx.headers.get("traceparent", "").split("-")
        # a use's end (its claim may be gone by now) notes no claim the trace map does not hold already
        if len(parent) == 4 and message.claim_uid and (message.event not in CLOSES or message.claim_uid in self.traces):
            self.traces[message.claim_uid] = parent[1]
        devices: list[DeviceKey] = [(message.driver, d.pool, d.device) for d in message.devices]
        if not devices:  # prepare-started / prepare-failed name no devices: the claim's allocation does
            claim = self.claims.get(ns, name) if self.informers else None
            devices = [d for d in model.claim_devices(claim or {}) if d[0] == message.driver]
        text = f"claim {ns}/{name} {message.event} on {message.node}"
        if message.error:
            text += f": {message.error}"
        for device in devices:
            self._history(device, message.event, text, ns, message.observed_at or None)
            self._mark(self._pool_node.get(device[1], message.node))

    async def _on_health_event(self, message: DeviceHealth, ctx: MsgContext) -> None:
        health = Health(
            unhealthy=message.state == "Unhealthy",
            xid=message.xid,
            reason=message.reason,
            time=k8s_time(message.observed_at or None),
        )
        self._health.setdefault(message.node, {})[message.device] = health
        what = f"XID {message.xid}" if message.reason == "xid" else (message.reason or message.state)
        summary = f"{message.state}: {what}" + (f" ({message.message})" if message.message else "")
        ring = self._rings.setdefault((message.node, message.device), deque(maxlen=RING))
        ring.append(DeviceEvent(time=health.time, type="health", summary=summary))
        self._mark(message.node)

    def _forget_live_health(self) -> None:
        """After a reconnect the live health may have missed a recovery: the slices' taints say again."""
        for node in list(self._health):
            self._mark(node)
        self._health.clear()

    # ---- dirty rows -> new rows, deltas --------------------------------------------------------------

    def flush(self) -> None:
        """Rebuild the dirty rows, bump the version, wake the viewers."""
        self._flush_handle = None
        dirty, self._dirty = self._dirty, set()
        pending, self._pending_dirty = self._pending_dirty, False
        telemetry, self._telemetry_dirty = self._telemetry_dirty, set()
        if telemetry:  # new samples are sent on their own (`telemetry` events): no row is rebuilt for them
            for viewer in self.viewers:
                viewer.telemetry |= telemetry
                viewer.wake.set()
        if not dirty and not pending:
            return
        allocations = _Allocations(self._allocs)
        changed: set[str] = set()
        for name in dirty:
            slice_names = self._slices_of.get(name)
            old = self.rows.get(name)
            if old is not None:
                model.add_counters(self.counters, self._row_counters.pop(name, {}), -1)
            if not slice_names:
                self.encoded.pop(name, None)
                if self.rows.pop(name, None) is not None:
                    changed.add(name)
                continue
            slices = [s for s in (self.slices.get("", n) for n in slice_names) if s is not None]
            row = model.node_row(
                name,
                slices,
                self.nodes.get("", name),
                allocations,
                self._health.get(name, {}),
                self._domains_of.get(name, ()),
            )
            counts = model.node_counters(row)
            self._row_counters[name] = counts
            model.add_counters(self.counters, counts)
            if row != old:
                self.rows[name] = row
                self.encoded.pop(name, None)
                changed.add(name)
        if not changed and not pending:
            return
        self.version += 1
        self.generated_at = k8s_time()
        self.groups = model.groups(self.rows.values())
        for viewer in self.viewers:
            viewer.changed |= changed
            viewer.pending |= pending
            viewer.wake.set()

    def add_viewer(self) -> Viewer:
        viewer = Viewer()
        self.viewers.add(viewer)
        return viewer

    def remove_viewer(self, viewer: Viewer) -> None:
        self.viewers.discard(viewer)


class DiscoveryError(RuntimeError):
    """The API server could not be asked which APIs it serves."""


async def discover(kube: Kube) -> dict[str, Any]:
    """The FleetState options for this server: resource versions and whether ComputeDomains are served."""
    try:
        slices, claims = await resource_resources(kube.api_client)
        domains = await serves_compute_domains(kube.api_client)
    except ApiError as exc:
        raise DiscoveryError(
            f"cannot discover the served APIs: {exc}; check the API server and the dashboard's RBAC"
        ) from exc
    return {"slices": slices, "claims": claims, "compute_domains": domains}
