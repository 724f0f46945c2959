"""The core: claim + allocation + configs -> prepared devices, and the way back.

Owns the prepare/unprepare state machine per claim (checkpoint `PrepareStarted` -> side effects ->
CDI -> `PrepareCompleted`), idempotency, the overlap guard (a device held by another completed
claim is refused unless both share it by config), per-claim serialisation, rollback of partial
prepares (at start, on retry, and for stale claims periodically), and lifecycle events.
I/O goes through small ports: ClaimSource, Inventory, DeviceOps, CdiWriter, Checkpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec

from services.preparer import metrics
from services.preparer.cdi import CdiDevice, CdiWriter, DeviceNode, build_spec, device_id, mps_edits
from services.preparer.checkpoint import Checkpoint, ClaimRecord, PreparedDevice
from services.preparer.claims import ClaimNotFound, ClaimSource, ResourceClaim, selector_node_names
from services.preparer.configs import (
    ConfigError,
    GpuConfig,
    RawConfig,
    interval,
    mps_daemon_id,
    pinned_limits,
    select,
    strategy,
)
from services.preparer.devices import DeviceError, DeviceOps, Inventory, ResolvedDevice
from services.preparer.lifecycle import LifecycleEvents
from shared.events.claims import PreparedDeviceRef
from shared.logs import get_logger
from shared.telemetry import get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)


@dataclass(frozen=True)
class ClaimRef:
    uid: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}:{self.uid}"


@dataclass
class PrepareResult:
    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


class PrepareFailed(Exception):
    """A claim cannot be prepared as allocated; the message goes to the kubelet and the pod's events."""


@dataclass
class _Planned:
    result_index: int
    request: str
    pool: str
    resolved: ResolvedDevice
    admin_access: bool
    share_id: str


class Preparer:
    def __init__(self, *, driver: str, node: str, claims: ClaimSource, inventory: Inventory, ops: DeviceOps,
                 cdi: CdiWriter, checkpoint: Checkpoint, events: LifecycleEvents, pool: str = "") -> None:
        self.driver = driver
        self.node = node
        self.pool = pool or node
        self.claims = claims
        self.inventory = inventory
        self.ops = ops
        self.cdi = cdi
        self.checkpoint = checkpoint
        self.events = events
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    # -- prepare ---------------------------------------------------------------------------
    async def prepare(self, ref: ClaimRef) -> PrepareResult:
        async with self._locks[ref.uid]:
            record = self.checkpoint.claims.get(ref.uid)
            if record is not None and record.state == "PrepareCompleted":
                return PrepareResult(devices=list(record.devices))
            try:
                devices = await self._prepare(ref, record)
            except PrepareFailed as exc:
                message = f"error preparing devices for claim {ref}: {exc}"
                log.warning("prepare failed", claim=str(ref), error=str(exc))
                return PrepareResult(error=message)
            return PrepareResult(devices=devices)

    async def _fetch(self, ref: ClaimRef) -> ResourceClaim:
        with tracer.start_as_current_span("claim.get") as span:
            span.set_attribute("k8s.namespace.name", ref.namespace)
            span.set_attribute("dra.claim.name", ref.name)
            try:
                claim = await self.claims.get(ref.namespace, ref.name)
            except ClaimNotFound as exc:
                raise PrepareFailed(str(exc)) from None
            except Exception as exc:  # noqa: BLE001 - any fetch failure fails this claim, retried by the kubelet
                raise PrepareFailed(f"retrieve claim {ref.namespace}/{ref.name}: {exc}") from None
        if claim.metadata.uid != ref.uid:
            raise PrepareFailed(f"claim {ref.namespace}/{ref.name} got replaced (UID {claim.metadata.uid}, "
                                f"kubelet asked for {ref.uid})")
        if claim.status.allocation is None:
            raise PrepareFailed(f"claim {ref.namespace}/{ref.name} not allocated")
        return claim

    def _plan(self, claim: ResourceClaim) -> tuple[list[_Planned], list[RawConfig]]:
        allocation = claim.status.allocation
        assert allocation is not None
        pinned = selector_node_names(allocation.nodeSelector)
        if pinned is not None and self.node not in pinned:
            raise PrepareFailed(f"claim is allocated to node(s) {', '.join(sorted(pinned))}, not to this node "
                                f"{self.node}")
        results = allocation.devices.results if allocation.devices else []
        planned: list[_Planned] = []
        for index, result in enumerate(results):
            if result.driver != self.driver:
                continue
            if result.pool != self.pool:
                raise PrepareFailed(f"device {result.pool}/{result.device} is in pool {result.pool!r}, not this "
                                    f"node's pool {self.pool!r}: the claim is allocated to another node")
            try:
                resolved = self.inventory.resolve(result.device)
            except DeviceError as exc:
                raise PrepareFailed(str(exc)) from None
            planned.append(_Planned(index, result.request, result.pool, resolved, bool(result.adminAccess),
                                    result.shareID or ""))
        raw = [RawConfig(source=c.source, requests=list(c.requests or []),
                         driver=c.opaque.driver if c.opaque else "", parameters=c.opaque.parameters if c.opaque else None,
                         has_opaque=c.opaque is not None)
               for c in (allocation.devices.config if allocation.devices else [])]
        return planned, raw

    def _guard(self, ref: ClaimRef, planned: list[_Planned], shared_by_config: set[int]) -> None:
        for i, item in enumerate(planned):
            if item.admin_access:
                continue
            for uid, record, held in self.checkpoint.holders(item.resolved.name, exclude=ref.uid):
                if held.admin_access:
                    continue
                if held.shared and i in shared_by_config:
                    continue
                raise PrepareFailed(f"requested device {item.resolved.name} is already allocated to different "
                                    f"claim {record.namespace}/{record.name} ({uid}); share it by giving both "
                                    "claims a sharing config")

    async def _prepare(self, ref: ClaimRef, previous: ClaimRecord | None) -> list[PreparedDevice]:
        claim = await self._fetch(ref)
        planned, raw = self._plan(claim)
        with tracer.start_as_current_span("configs") as span:
            try:
                groups = select(self.driver, raw, [(p.request, p.resolved.kind) for p in planned])
                for group in groups:
                    if strategy(group.config) == "MPS" and not isinstance(group.config, GpuConfig):
                        raise ConfigError("MPS on MIG devices is not supported by this driver yet; use MPS on "
                                          "full GPUs or TimeSlicing")
            except ConfigError as exc:
                raise PrepareFailed(str(exc)) from None
            span.set_attribute("configs.groups", len(groups))
        shared = {i for g in groups if strategy(g.config) for i in g.results}
        self._guard(ref, planned, shared)
        if previous is not None:  # a PrepareStarted left by a failed or interrupted attempt
            await self._rollback(ref.uid, previous, reason="retry after an interrupted prepare")
        devices = [PreparedDevice(
            requests=[p.request.split("/", 1)[0]], pool=p.pool, device=p.resolved.name, kind=p.resolved.kind,
            uuid=p.resolved.uuid, parent_uuid=p.resolved.gpu.uuid if p.resolved.gpu and p.resolved.kind == "mig" else "",
            shared=i in shared, admin_access=p.admin_access, share_id=p.share_id,
            dynamic_mig=p.resolved.kind == "mig" and p.resolved.mig is None,
        ) for i, p in enumerate(planned)]
        for group in groups:
            for i in group.results:
                devices[i].sharing = strategy(group.config)
        generation = (previous.generation + 1) if previous is not None else 1
        record = ClaimRecord(state="PrepareStarted", name=ref.name, namespace=ref.namespace, generation=generation,
                             devices=devices, started_at=time.time(),
                             configs=[msgspec.to_builtins(g.config) for g in groups if g.explicit])
        await self.checkpoint.put(ref.uid, record)
        self._emit("prepare-started", ref, record)
        try:
            cdi_devices = await self._apply(ref, record, planned, groups)
            with tracer.start_as_current_span("cdi.write"):
                control = [DeviceNode(p, self.inventory.host_path(p)) for p in self.inventory.control_device_paths()]
                spec = build_spec(ref.uid, cdi_devices, control) if cdi_devices else None
                if spec is not None:
                    path = await self.cdi.write(ref.uid, spec)
                    record.cdi_spec = path.name
            for dev in record.devices:
                dev.cdi_device_ids = [device_id(ref.uid, dev.device)] if spec is not None else []
            record.state = "PrepareCompleted"
            record.completed_at = time.time()
            await self.checkpoint.put(ref.uid, record)
        except Exception as exc:
            log.warning("prepare failed after it started; rolling back", claim=str(ref), error=str(exc))
            await self._rollback(ref.uid, record, reason=str(exc))
            self._emit("prepare-failed", ref, record, error=str(exc))
            raise PrepareFailed(str(exc)) from None
        metrics.set_prepared(self.node, self.driver, self.checkpoint)
        self._emit("prepared", ref, record)
        log.info("claim prepared", claim=str(ref), devices=[d.device for d in record.devices])
        return list(record.devices)

    async def _apply(self, ref: ClaimRef, record: ClaimRecord, planned: list[_Planned],
                     groups: list) -> list[CdiDevice]:  # type: ignore[type-arg]
        """Time-slicing, MPS and dynamic MIG through discovery; returns the per-device CDI edits."""
        cdi_devices: dict[int, CdiDevice] = {}
        for i, item in enumerate(planned):
            res = item.resolved
            nodes = [DeviceNode(f"/dev/nvidia{res.minor}", self.inventory.host_path(f"/dev/nvidia{res.minor}"))]
            if res.kind == "mig":
                mig = res.mig
                if mig is None:
                    assert res.gpu is not None and res.profile is not None and res.placement is not None
                    with tracer.start_as_current_span("device.mig-create") as span:
                        span.set_attribute("dra.device", res.name)
                        reply = await self.ops.mig_create(res.gpu.uuid, res.profile.name, res.placement)
                    mig = reply.device
                    if mig is None or mig.name != res.name:
                        raise DeviceError(f"discovery created MIG device {mig.name if mig else '?'}, expected {res.name}")
                    record.devices[i].uuid = mig.uuid
                    await self.checkpoint.put(ref.uid, record)  # rollback must know what exists now
                    await self.inventory.wait_mig(mig.uuid, present=True)
                nodes += [DeviceNode(p, self.inventory.host_path(p)) for p in mig.device_path_caps]
            cdi_devices[i] = CdiDevice(device=res.name, nodes=nodes)
        for group in groups:
            kind = strategy(group.config)
            gpu_uuids = sorted({planned[i].resolved.uuid for i in group.results if planned[i].resolved.kind == "gpu"})
            if kind == "TimeSlicing" and gpu_uuids:
                with tracer.start_as_current_span("device.set-sharing"):
                    await self.ops.set_sharing(gpu_uuids, "Default", interval(group.config))
                record.timesliced_gpus = sorted(set(record.timesliced_gpus) | set(gpu_uuids))
                await self.checkpoint.put(ref.uid, record)
            elif kind == "MPS" and gpu_uuids:
                assert isinstance(group.config, GpuConfig) and group.config.sharing is not None
                mps = group.config.sharing.mpsConfig
                daemon = mps_daemon_id(ref.uid, gpu_uuids)
                try:
                    limits = pinned_limits(mps, gpu_uuids)
                except ConfigError as exc:
                    raise PrepareFailed(str(exc)) from None
                record.mps_daemon_id = daemon
                await self.checkpoint.put(ref.uid, record)
                with tracer.start_as_current_span("device.mps-start"):
                    started = await self.ops.mps_start(daemon, gpu_uuids,
                                                       mps.defaultActiveThreadPercentage if mps else None, limits)
                env, mounts = mps_edits(started.pipe_dir, started.shm_dir)
                for i in group.results:
                    cdi_devices[i].env += env
                    cdi_devices[i].mounts += mounts
        return [cdi_devices[i] for i in sorted(cdi_devices)]

    # -- unprepare and rollback ------------------------------------------------------------
    async def unprepare(self, ref: ClaimRef) -> str:
        """"" on success (also for a claim never prepared here), else the reason to retry."""
        async with self._locks[ref.uid]:
            record = self.checkpoint.claims.get(ref.uid)
            if record is None:
                log.info("unprepare noop: claim not found in checkpoint", claim=str(ref))
                return ""
            try:
                await self._undo(ref.uid, record)
                await self.checkpoint.remove(ref.uid)
            except Exception as exc:  # noqa: BLE001 - the kubelet retries unprepare
                log.warning("unprepare failed", claim=str(ref), error=str(exc))
                return f"error unpreparing devices for claim {ref}: {exc}"
        self._locks.pop(ref.uid, None)
        metrics.set_prepared(self.node, self.driver, self.checkpoint)
        self._emit("unprepared", ClaimRef(ref.uid, record.namespace, record.name), record)
        return ""

    def _still_used(self, uid: str, device: str) -> bool:
        return any(r.state == "PrepareCompleted" for _, r, _ in self.checkpoint.holders(device, exclude=uid))

    async def _undo(self, uid: str, record: ClaimRecord) -> None:
        """Undo a claim's side effects (idempotent: safe to repeat after a crash or a failure)."""
        for dev in record.devices:
            if not dev.dynamic_mig or self._still_used(uid, dev.device):
                continue
            mig_uuid = dev.uuid
            if not mig_uuid:  # interrupted between create and checkpoint: ask the live inventory
                if not self.inventory.live:
                    raise DeviceError(f"cannot tell whether MIG device {dev.device} was created before the "
                                      "interruption until discovery's inventory arrives; will retry")
                mig_uuid = self._live_mig_uuid(dev.device)
            if mig_uuid:
                with tracer.start_as_current_span("device.mig-destroy"):
                    await self.ops.mig_destroy(dev.parent_uuid, mig_uuid)
                    await self.inventory.wait_mig(mig_uuid, present=False)
        if record.mps_daemon_id:
            with tracer.start_as_current_span("device.mps-stop"):
                await self.ops.mps_stop(record.mps_daemon_id)
        if record.timesliced_gpus:
            held = {d.uuid for u, r in self.checkpoint.claims.items() if u != uid and r.state == "PrepareCompleted"
                    for d in r.devices if d.sharing == "TimeSlicing"}
            reset = [u for u in record.timesliced_gpus if u not in held]
            if reset:
                with tracer.start_as_current_span("device.set-sharing"):
                    await self.ops.set_sharing(reset, "Default", "Default")
        with tracer.start_as_current_span("cdi.remove"):
            await self.cdi.remove(uid)

    def _live_mig_uuid(self, name: str) -> str:
        try:
            resolved = self.inventory.resolve(name)
        except DeviceError:
            return ""
        return resolved.mig.uuid if resolved.mig is not None else ""

    async def _rollback(self, uid: str, record: ClaimRecord, *, reason: str) -> None:
        """Undo a partial prepare and forget it; if undo fails the PrepareStarted entry stays for a later try."""
        try:
            await self._undo(uid, record)
        except Exception as exc:  # noqa: BLE001
            log.error("rollback of a partial prepare failed; will retry", claim_uid=uid, error=str(exc))
            raise PrepareFailed(f"rollback of an earlier partial prepare failed: {exc}") from None
        await self.checkpoint.remove(uid)
        self._emit("rolled-back", ClaimRef(uid, record.namespace, record.name), record, error=reason)
        log.info("partial prepare rolled back", claim=f"{record.namespace}/{record.name}:{uid}", reason=reason)

    async def recover(self, *, only_failed: bool = False) -> int:
        """Roll back PrepareStarted claims no prepare is working on: at start all of them (a crash
        interrupted them), later those whose rollback failed before. Returns how many were rolled back."""
        done = 0
        for uid, record in list(self.checkpoint.by_state("PrepareStarted").items()):
            lock = self._locks[uid]
            if only_failed and lock.locked():
                continue
            async with lock:
                if self.checkpoint.claims.get(uid) is not record:
                    continue  # prepared or rolled back meanwhile
                try:
                    await self._rollback(uid, record, reason="interrupted prepare found at start"
                                         if not only_failed else "partial prepare left by a failed rollback")
                    done += 1
                except PrepareFailed:
                    continue
        metrics.set_prepared(self.node, self.driver, self.checkpoint)
        return done

    async def cleanup_stale(self) -> int:
        """Roll back PrepareStarted claims whose ResourceClaim is gone or no longer allocated here."""
        done = 0
        for uid, record in list(self.checkpoint.by_state("PrepareStarted").items()):
            lock = self._locks[uid]
            if lock.locked() or not record.name:
                continue  # being prepared right now, or a legacy entry without a name
            try:
                claim = await self.claims.get(record.namespace, record.name)
                stale = claim.metadata.uid != uid or claim.status.allocation is None or not any(
                    r.driver == self.driver and r.pool == self.pool
                    for r in (claim.status.allocation.devices.results if claim.status.allocation.devices else []))
            except ClaimNotFound:
                stale = True
            except Exception as exc:  # noqa: BLE001 - transient: next round
                log.info("stale-claim check deferred", claim_uid=uid, error=str(exc))
                continue
            if not stale:
                log.info("partially prepared claim not stale", claim=f"{record.namespace}/{record.name}")
                continue
            async with lock:
                if self.checkpoint.claims.get(uid) is record:
                    try:
                        await self._rollback(uid, record, reason="stale claim (deleted or not allocated here)")
                        done += 1
                    except PrepareFailed:
                        continue
        return done

    # -- events ----------------------------------------------------------------------------
    def _emit(self, event: str, ref: ClaimRef, record: ClaimRecord, error: str = "") -> None:
        refs = [PreparedDeviceRef(request=d.requests[0] if d.requests else "", pool=d.pool, device=d.device,
                                  uuid=d.uuid, sharing=d.sharing, cdi_device_ids=list(d.cdi_device_ids))
                for d in record.devices]
        self.events.emit(event, uid=ref.uid, namespace=ref.namespace, name=ref.name,  # type: ignore[arg-type]
                         generation=record.generation, devices=refs, error=error)
