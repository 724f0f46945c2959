"""The `gpu.nvidia.com` driver (a `host.port.DriverPort`): claim + allocation + configs -> GPUs and MIG devices.

Owns what a GPU prepare does inside the claim state machine (`claimstate`, which writes every record, spec
and event): device resolution, opaque configs, the overlap guard (a device held by another completed claim
is refused unless both share it by config: `sharing`), time-slicing, MPS, dynamic MIG and NVLink partitions
(`partitions`) through discovery, VFIO passthrough (`vfio`), the claim's CDI edits (its devices' nodes plus
the node's common edits, the driver userspace, from `commonedits`), and the way back. I/O goes through small
ports: Inventory, DeviceOps, Passthrough, ClaimRecords (the checkpoint, read only).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import msgspec
from opentelemetry import trace

from services.preparer.gpu.commonedits import CommonEdits
from services.preparer.gpu.partitions import Partitions, whole_gpus
from services.preparer.gpu.sharing import Mode, Planned, conflict, group_pinned_limits, share_capacity, share_modes
from services.preparer.gpu.vfio import Passthrough, VfioSettings, passthrough_conflict
from services.preparer.host.cdi import CdiDevice, Mount, gpu_device_nodes, mps_edits, mps_share_env
from services.preparer.host.checkpoint import ClaimRecord, PreparedDevice
from services.preparer.host.claims import AllocationResult, ResourceClaim
from services.preparer.host.devices import DeviceError, DeviceOps, Inventory, ResolvedDevice
from services.preparer.host.metadatafiles import MetadataSource
from services.preparer.host.port import (
    RECORD,
    ClaimRecords,
    ClaimRef,
    Plan,
    PrepareFailed,
    Record,
    SpecEdits,
)
from services.preparer.nodesettings import NodeSettings
from shared import featuregates
from shared.claimconfigs import (
    ClaimConfigError,
    GpuConfig,
    RawConfig,
    Selected,
    VfioDeviceConfig,
    check_gates,
    interval,
    mps_daemon_id,
    select,
    share_daemon_id,
    strategy,
)
from shared.events.inventory import MigDevice
from shared.logs import get_logger
from shared.telemetry import get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)

MAX_RESULTS = 32  # upstream AllocationResultsMaxSize: a claim holds at most 32 devices


def _daemon_key(p: Planned) -> str:
    """What names the MPS daemon of a share's device: its UUID, or for a MIG device made on demand (which has none
    until its first share makes it, and a new one each time it is made again) its parent GPU and its name."""
    if p.dynamic_mig and p.resolved.gpu is not None:
        return f"{p.resolved.gpu.uuid}/{p.resolved.name}"
    return p.resolved.uuid


def _vfio_config(groups: list[Selected], planned: list[Planned]) -> VfioDeviceConfig | None:
    """The claim's one VfioDeviceConfig when it holds passthrough GPUs (None when it holds none); a claim
    holds passthrough GPUs only, under one config, as NVIDIA's driver assumes (ClaimConfigError if not)."""
    vfio = [g for g in groups if any(planned[i].resolved.kind == "vfio" for i in g.results)]
    if not vfio:
        return None
    if len(vfio) != len(groups) or len(vfio) > 1:
        raise ClaimConfigError(
            "a claim with passthrough GPUs (vfio.gpu.nvidia.com) holds passthrough GPUs only, "
            "under one VfioDeviceConfig: its containers get no NVIDIA driver"
        )
    assert isinstance(vfio[0].config, VfioDeviceConfig)
    return vfio[0].config


@dataclass
class _Work:
    """A GPU claim's plan, as `apply` needs it."""

    planned: list[Planned]
    groups: list[Selected]
    modes: dict[int, Mode]
    vfio_config: VfioDeviceConfig | None


class GpuDriver:
    """The GPU side of a claim's prepare and unprepare (see the module doc)."""

    resumable = False  # a PrepareStarted is an interrupted prepare: rolled back, never resumed

    def __init__(
        self,
        *,
        driver: str,
        inventory: Inventory,
        ops: DeviceOps,
        records: ClaimRecords,
        common: CommonEdits,
        settings: NodeSettings | None = None,
        vfio: VfioSettings | None = None,
        gates: featuregates.FeatureGates | None = None,
    ) -> None:
        self.driver = driver
        self.records = records
        self.settings = settings or NodeSettings()  # the node config's setting per GPU (time-slicing)
        self.gates = gates if gates is not None else featuregates.FeatureGates()  # a gated device is refused
        self.inventory = inventory
        self.ops = ops
        self.common = common  # the node's driver userspace, in every claim spec
        self.passthrough = Passthrough(vfio or VfioSettings(), inventory.host_path)  # gpu-vfio-<minor> devices
        self.partitions = Partitions(ops, records, inventory)  # NVLink partitions (Fabric Manager)
        # per device-level resource several claims may use (a shared MPS daemon by its id, a dynamic MIG device by
        # its name): its start or create and its stop or destroy (with the count of its users) do not interleave
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # per shared MPS daemon this process started or confirmed, and has not asked to stop since: the
        # settings it runs with and the CDI env and mounts that reach it (`_running_share_daemon`)
        self._share_daemons: dict[str, tuple[dict[str, int], list[str], list[Mount]]] = {}
        self._published: tuple[object, dict[str, str]] = (None, {})  # an inventory and its devices' daemons

    def _resolve(
        self, uid: str, claim: ResourceClaim, ours: list[tuple[int, AllocationResult]]
    ) -> tuple[list[Planned], list[RawConfig]]:
        allocation = claim.status.allocation
        assert allocation is not None
        planned: list[Planned] = []
        if len(ours) > MAX_RESULTS:
            raise PrepareFailed(
                f"the claim is allocated {len(ours)} devices of this driver, more than the "
                f"{MAX_RESULTS} a claim may hold",
                "invalid-config",
            )
        for index, result in ours:
            try:
                resolved = self.inventory.resolve(result.device)
            except DeviceError as exc:
                raise PrepareFailed(str(exc), "device-error") from None
            planned.append(
                Planned(
                    index,
                    result.request,
                    result.pool,
                    resolved,
                    bool(result.adminAccess),
                    result.shareID or "",
                    {k: str(v) for k, v in (result.consumedCapacity or {}).items()},
                    dynamic_mig=resolved.kind == "mig" and (resolved.mig is None or self._made_for(resolved.name, uid)),
                )
            )
        raw = [
            RawConfig(
                source=c.source,
                requests=list(c.requests or []),
                driver=c.opaque.driver if c.opaque else "",
                parameters=c.opaque.parameters if c.opaque else None,
                has_opaque=c.opaque is not None,
            )
            for c in (allocation.devices.config if allocation.devices else [])
        ]
        return planned, raw

    def _guard(self, ref: ClaimRef, planned: list[Planned], modes: dict[int, Mode]) -> None:
        """Refuse, before any side effect, a device another claim holds in a way this claim cannot join."""
        for i, item in enumerate(planned):
            if item.admin_access:
                continue
            if why := passthrough_conflict(self.records, ref.uid, item.resolved):
                raise PrepareFailed(
                    f"requested device {item.resolved.name} cannot be prepared for this claim: {why}", "device-busy"
                )
            # one holder per way the device is held: the rule reads nothing else (`Checkpoint.holds`)
            for uid, record, held in self.records.holds(item.resolved.name, exclude=ref.uid):
                if held.admin_access:
                    continue
                why = conflict(modes[i], held)
                if modes[i].shared and held.shared and not why:
                    continue
                # The holder may be another tenant's claim: the log names it, the reply (this claim's) does not.
                log.warning(
                    "device held by another claim",
                    claim=str(ref),
                    device=item.resolved.name,
                    holder=f"{record.namespace}/{record.name}:{uid}",
                    holder_state=record.state,
                    conflict=why,
                )
                if why:
                    raise PrepareFailed(
                        f"requested device {item.resolved.name} cannot be prepared for this claim: {why}", "device-busy"
                    )
                raise PrepareFailed(
                    f"requested device {item.resolved.name} is already allocated to a different "
                    "claim on this node; share it by giving both claims a sharing config",
                    "device-busy",
                )

    def _node_time_slicing(self, groups: list[Selected], planned: list[Planned], modes: dict[int, Mode]) -> None:
        """Whole GPUs whose NodeConfig rule says `timeSlicing`: a claim without a sharing config gets the rule's
        interval (a claim's own TimeSlicing config keeps its interval); a claim-scoped MPS config on such a GPU
        conflicts with its mode (ClaimConfigError). Read now: a changed rule applies to the next prepare."""
        for group in groups:
            kind = strategy(group.config)
            for i in group.results:
                res = planned[i].resolved
                if res.kind != "gpu" or res.gpu is None or planned[i].share_id or kind == "TimeSlicing":
                    continue
                setting = self.settings.setting(res.gpu)
                if setting.sharing != "timeSlicing":
                    continue
                if kind == "MPS":
                    raise ClaimConfigError(
                        f"device {res.name} is time-sliced by NodeConfig rule {setting.rule}; a "
                        "claim's MPS config does not fit its mode (use TimeSlicing, or a GPU "
                        "whose rule offers mpsShares)"
                    )
                modes[i].sharing = "TimeSlicing"
                modes[i].interval = setting.time_slice_interval
                if setting.time_slice_interval != "Default":  # the GPU's own default: nothing to set or reset
                    modes[i].node_interval = setting.time_slice_interval

    async def plan(self, ref: ClaimRef, claim: ResourceClaim, results: list[tuple[int, AllocationResult]]) -> Plan:
        planned, raw = self._resolve(ref.uid, claim, results)
        if any(p.resolved.kind == "gpu" and not p.share_id for p in planned):
            await self.settings.synced()  # a whole GPU's NodeConfig rule may time-slice it
        try:
            for p in planned:
                check_gates(
                    p.resolved.kind,
                    share=bool(p.share_id),
                    enabled=self.gates.enabled,
                    dynamic_mig=p.dynamic_mig,
                )
            groups = select(self.driver, raw, [(p.request, p.resolved.kind) for p in planned])
            for group in groups:
                if (
                    strategy(group.config) == "MPS"
                    and not isinstance(group.config, GpuConfig)
                    and not all(planned[i].share_id for i in group.results)
                ):
                    raise ClaimConfigError(
                        "MPS on MIG devices is served to shares only (allocations with a "
                        "shareID, mpsShares); a claim-scoped MPS daemon on a whole MIG "
                        "device is not supported: use shares, or TimeSlicing"
                    )
                group_pinned_limits(group, planned)  # each limit fits its GPU's memory
            modes = share_modes(groups, planned)
            self._node_time_slicing(groups, planned, modes)
            vfio_config = _vfio_config(groups, planned)
        except ClaimConfigError as exc:
            raise PrepareFailed(str(exc), "invalid-config") from None
        trace.get_current_span().set_attribute("configs.groups", len(groups))  # on the claim's span
        self._guard(ref, planned, modes)
        partition = self.partitions.plan(whole_gpus((p.resolved, p.admin_access) for p in planned))
        devices = [
            PreparedDevice(
                requests=[p.request.split("/", 1)[0]],
                pool=p.pool,
                device=p.resolved.name,
                kind=p.resolved.kind,
                uuid=p.resolved.uuid,
                parent_uuid=p.resolved.gpu.uuid if p.resolved.gpu and p.resolved.kind == "mig" else "",
                shared=modes[i].shared,
                admin_access=p.admin_access,
                share_id=p.share_id,
                consumed_capacity=dict(p.consumed),
                capacity=share_capacity(p, self.settings),
                sharing=modes[i].sharing,
                time_slice_interval=modes[i].interval,
                mps_daemon_settings=dict(modes[i].daemon_settings),
                # a share's user mark is in its start record (the one write before the daemon's start, if any)
                mps_daemon=share_daemon_id(_daemon_key(p)) if modes[i].share_mps else "",
                dynamic_mig=p.dynamic_mig,
                pci_bus_id=self.passthrough.address(p.resolved) if p.resolved.kind == "vfio" else "",
            )
            for i, p in enumerate(planned)
        ]
        # a MIG device is created or a GPU leaves nvidia first: the record must be on disk before, so a crash
        # leaves it to undo (else it is staged: the next write carries it)
        return Plan(
            devices=devices,
            configs=[msgspec.to_builtins(g.config) for g in groups if g.explicit],
            fabric_partition=partition,
            record_first=any((d.dynamic_mig and not d.uuid) or d.pci_bus_id for d in devices),
            work=_Work(planned, groups, modes, vfio_config),
        )

    def resumes(self, previous: ClaimRecord, plan: Plan) -> bool:
        return False

    async def apply(
        self, ref: ClaimRef, claim: ResourceClaim, plan: Plan, record: ClaimRecord
    ) -> AsyncGenerator[Record | SpecEdits, None]:
        """NVLink partition, VFIO through sysfs, dynamic MIG, MPS and time-slicing through discovery, each
        side effect a crash could leave behind after `RECORD`; then the claim's CDI edits."""
        work: _Work = plan.work
        planned, modes = work.planned, work.modes
        cdi_devices: dict[int, CdiDevice] = {}
        if record.fabric_partition >= 0:
            yield RECORD  # the partition's record on disk before its activation (`partitions` module doc)
            await self.partitions.activate(
                ref.uid, record.fabric_partition, whole_gpus((p.resolved, p.admin_access) for p in planned)
            )
        for i, item in enumerate(planned):
            res = item.resolved
            caps: list[str] = []
            if res.kind == "vfio":  # its PCI address is on disk (`record_first`) before the GPU leaves nvidia
                assert work.vfio_config is not None
                dev = record.devices[i]
                with tracer.start_as_current_span("device.vfio-bind") as span:
                    span.set_attribute("dra.device", res.name)
                    dev.iommu_group = await self.passthrough.acquire(dev.pci_bus_id, res.minor)
                cdi_devices[i] = CdiDevice(
                    device=res.name,
                    nodes=self.passthrough.device_nodes(dev.pci_bus_id, dev.iommu_group, work.vfio_config),
                )
                continue
            if res.kind == "mig":
                mig = res.mig
                if item.dynamic_mig:
                    async with contextlib.aclosing(self._make_mig(res, record.devices[i], plan.record_first)) as steps:
                        async for step in steps:
                            yield step
                    mig = self._live_mig(res.name)
                    if mig is None or mig.uuid != record.devices[i].uuid:
                        raise DeviceError(f"MIG device {res.name} is gone from discovery's inventory")
                assert mig is not None
                caps = list(mig.device_path_caps)
            cdi_devices[i] = CdiDevice(
                device=res.name, nodes=gpu_device_nodes(res.minor, self.inventory.host_path, caps)
            )
        for i, mode in modes.items():
            if mode.share_mps:
                dev = record.devices[i]
                # Unlocked, no start or stop of the daemon is under way; the check and its use run with no await
                # in between, so none can begin before this share's record (staged) counts as a user of it.
                known = None if self._locks[dev.mps_daemon].locked() else self._running_share_daemon(ref.uid, dev)
                if known is None:
                    async with contextlib.aclosing(self._start_share_daemon(ref.uid, dev)) as steps:
                        async for step in steps:
                            yield step
                    known = self._share_daemons[dev.mps_daemon][1:]
                env, mounts = known
                cdi_devices[i].env += env
                cdi_devices[i].env += mps_share_env(mode.limits.memory, mode.limits.compute)
                cdi_devices[i].mounts += mounts
        slices: dict[str, set[str]] = defaultdict(set)  # time-slice interval -> the GPUs that get it
        for i, mode in modes.items():
            if mode.node_interval:
                slices[mode.node_interval].add(planned[i].resolved.uuid)
        for group in work.groups:
            kind = strategy(group.config)
            gpu_uuids = sorted(
                {
                    planned[i].resolved.uuid
                    for i in group.results
                    if planned[i].resolved.kind == "gpu" and not modes[i].share_mps
                }
            )
            if kind == "TimeSlicing" and gpu_uuids:
                slices[interval(group.config)].update(gpu_uuids)
            elif kind == "MPS" and gpu_uuids:
                assert isinstance(group.config, GpuConfig) and group.config.sharing is not None
                mps = group.config.sharing.mpsConfig
                daemon = mps_daemon_id(ref.uid, gpu_uuids)
                limits = group_pinned_limits(group, planned)  # validated before the prepare started
                record.mps_daemon_id = daemon
                yield RECORD  # recorded before the start: rollback stops whatever got started
                with tracer.start_as_current_span("device.mps-start"):
                    started = await self.ops.mps_start(
                        daemon, gpu_uuids, mps.defaultActiveThreadPercentage if mps else None, limits
                    )
                env, mounts = mps_edits(started.pipe_dir, started.shm_dir)
                for i in group.results:
                    if not modes[i].share_mps:
                        cdi_devices[i].env += env
                        cdi_devices[i].mounts += mounts
        if slices:
            # Recorded before the call: a crash, failure or timeout of the call still leaves the GPUs to reset.
            record.timesliced_gpus = sorted(set(record.timesliced_gpus).union(*slices.values()))
            yield RECORD
            for slice_interval, uuids in sorted(slices.items()):
                with tracer.start_as_current_span("device.set-sharing"):
                    await self.ops.set_sharing(sorted(uuids), "Default", slice_interval)
        devices = [cdi_devices[i] for i in sorted(cdi_devices)]
        common = (
            self.passthrough.common_edits(work.vfio_config)
            if work.vfio_config is not None
            else await self.common.get(self.inventory.dev_root)
        )
        yield SpecEdits(
            devices,
            common,
            [MetadataSource(p.request, d, p.resolved.gpu) for p, d in zip(planned, record.devices, strict=True)],
            shared=all(p.share_id for p in planned),  # a share's edits: its device's, its daemon's, its limits
        )

    async def _start_share_daemon(self, uid: str, dev: PreparedDevice) -> AsyncGenerator[Record, None]:
        """Start or confirm the device's one MPS daemon for its shares, under its lock, when `apply` could not
        find it known to run (`_running_share_daemon`): discovery's start is idempotent, so the other shares
        confirm what the first started. The share's record marks it a user of the daemon, on disk (`RECORD`)
        before any start request, so the undo stops the daemon only when no other record uses it; with no
        request the record may stay staged. On success `_share_daemons` holds the daemon's env and mounts.
        MPS on MIG: one daemon per MIG device (its UUID, CUDA_VISIBLE_DEVICES=MIG-<uuid>), as NVIDIA
        documents it and its DRA driver does; discovery keeps the parent GPU in EXCLUSIVE_PROCESS while any
        of its MIG devices has a daemon, and a share's client sees its MIG device as device 0
        (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>)."""
        daemon = dev.mps_daemon
        async with self._locks[daemon]:
            if self._running_share_daemon(uid, dev) is not None:
                return
            yield RECORD
            settings = dev.mps_daemon_settings
            limit = settings.get("pinnedDeviceMemoryLimitMiB")
            with tracer.start_as_current_span("device.mps-start") as span:
                span.set_attribute("dra.share_id", dev.share_id)
                try:
                    started = await self.ops.mps_start(
                        daemon,
                        [dev.uuid],
                        settings.get("activeThreadPercentage"),
                        {dev.uuid: limit << 20} if limit else {},
                    )
                except BaseException:
                    self._share_daemons.pop(daemon, None)  # in an unknown state now: the next share asks
                    raise
            env, mounts = mps_edits(started.pipe_dir, started.shm_dir)
            self._share_daemons[daemon] = (dict(settings), env, mounts)

    async def _make_mig(self, res: ResolvedDevice, dev: PreparedDevice, on_disk: bool) -> AsyncGenerator[Record, None]:
        """Make the dynamic MIG device `res` for the claim whose record holds `dev`, unless it exists: made for
        another claim that still holds it (a share of it), it is used as it is. Under the device's lock, so that
        one create serves every share and no destroy (`undo`) runs in between. The record is on disk before a
        create (`on_disk`: it was written first; a share planned to join a device since destroyed writes it
        here), and again once the device's UUID is known, so a crash leaves the device to its undo."""
        async with self._locks[res.name]:
            live = self._live_mig(res.name)
            if live is not None:
                dev.uuid = live.uuid  # a staged record: the next write carries it
                return
            assert res.gpu is not None and res.profile is not None and res.placement is not None
            if dev.uuid or not on_disk:  # planned to join a device that is gone since: made here after all
                dev.uuid = ""
                yield RECORD
            with tracer.start_as_current_span("device.mig-create") as span:
                span.set_attribute("dra.device", res.name)
                reply = await self.ops.mig_create(res.gpu.uuid, res.profile.name, res.placement)
            mig = reply.device
            if mig is None or mig.name != res.name:
                raise DeviceError(f"discovery created MIG device {mig.name if mig else '?'}, expected {res.name}")
            dev.uuid = mig.uuid
            yield RECORD  # rollback must know what exists now
            await self.inventory.wait_mig(mig.uuid, present=True)

    def _made_for(self, name: str, uid: str) -> bool:
        """Whether MIG device `name` was made on demand for claims other than `uid` that still hold it."""
        return any(dev.dynamic_mig for _, _, dev in self.records.holders(name, exclude=uid))

    def _running_share_daemon(self, uid: str, dev: PreparedDevice) -> tuple[list[str], list[Mount]] | None:
        """The CDI env and mounts that reach `dev`'s daemon when it is known to run with `dev`'s settings (one more
        share needs no `mps-start` round trip); None when discovery must start or confirm it. Under the
        daemon's lock, or while no one holds it. Known means all three of:
        1. this process started or confirmed it with these settings and has asked no stop of it since (a
           stop, or a failed or interrupted start, forgets it), so its pipe and shm dirs are the reply's;
        2. another claim's completed share uses it with the same settings (no stop before that one's undo);
        3. discovery's live inventory (its KV, not the local cache) names it as the device's daemon:
           discovery drops a daemon that is gone and restarts or gives up one that exits unasked, so the
           next share then goes to discovery, whose start brings it back. A preparer restart empties (1)."""
        known = self._share_daemons.get(dev.mps_daemon)
        if known is None or known[0] != dev.mps_daemon_settings:
            return None
        inv = self.inventory.current
        if not self.inventory.live or inv is None:
            return None
        if self._published[0] is not inv:  # GPU and MIG device UUIDs -> the daemon discovery names for them
            self._published = (
                inv,
                {
                    **{g.uuid: g.sharing.mps_daemon for g in inv.gpus},
                    **{m.uuid: m.mps_daemon for g in inv.gpus for m in g.mig_devices},
                },
            )
        if self._published[1].get(dev.uuid) != dev.mps_daemon:
            return None
        for _, record, held in self.records.daemon_users(dev.mps_daemon, exclude=uid):
            if record.state == "PrepareCompleted" and held.mps_daemon_settings == dev.mps_daemon_settings:
                return known[1], known[2]
        return None

    # -- unprepare -------------------------------------------------------------------------
    def _still_used(self, uid: str, device: str) -> bool:
        return any(r.state == "PrepareCompleted" for _, r, _ in self.records.holders(device, exclude=uid))

    async def undo(self, uid: str, record: ClaimRecord) -> None:
        """Undo a claim's side effects (idempotent: safe to repeat after a crash or a failure); the machine
        removes its CDI spec and metadata files after."""
        for dev in record.devices:
            if dev.pci_bus_id and not self._still_used(uid, dev.device):
                with tracer.start_as_current_span("device.vfio-unbind"):
                    await self.passthrough.release(dev.pci_bus_id)
        await self.partitions.release(uid, record)  # after its GPUs are back on nvidia, as NVIDIA's driver does
        if record.mps_daemon_id:
            with tracer.start_as_current_span("device.mps-stop"):
                await self.ops.mps_stop(record.mps_daemon_id)
        for daemon in sorted({d.mps_daemon for d in record.devices if d.mps_daemon}):
            await self._release_share_daemon(uid, daemon)
        for dev in record.devices:  # after its MPS daemon, which runs on it, has stopped
            if dev.dynamic_mig:
                await self._destroy_mig(uid, dev)
        if record.timesliced_gpus:
            reset = [
                gpu
                for gpu in record.timesliced_gpus
                if not any(
                    r.state == "PrepareCompleted" and d.sharing == "TimeSlicing" and d.uuid == gpu
                    for _, r, d in self.records.gpu_holders(gpu, exclude=uid)
                )
            ]
            if reset:
                with tracer.start_as_current_span("device.set-sharing"):
                    await self.ops.set_sharing(reset, "Default", "Default")

    async def _release_share_daemon(self, uid: str, daemon: str) -> None:
        """Stop a GPU's shared MPS daemon when no other claim's record (prepared, or being prepared) uses it:
        the count is the checkpoint's, so a restart neither stops a daemon in use nor keeps one unused."""
        async with self._locks[daemon]:
            if next(self.records.daemon_users(daemon, exclude=uid), None) is not None:
                log.info("shared MPS daemon kept: other shares use it", claim_uid=uid, daemon=daemon)
                return
            self._share_daemons.pop(daemon, None)  # forgotten before the stop: a failed stop leaves it unknown
            with tracer.start_as_current_span("device.mps-stop"):
                await self.ops.mps_stop(daemon)

    async def _destroy_mig(self, uid: str, dev: PreparedDevice) -> None:
        """Destroy the dynamic MIG device `dev` of claim `uid` unless another claim's record (prepared, or being
        prepared) holds it: the last holder's undo destroys it. Under the device's lock (`_make_mig`)."""
        async with self._locks[dev.device]:
            if self.records.holders(dev.device, exclude=uid):
                log.info("dynamic MIG device kept: other claims hold it", claim_uid=uid, device=dev.device)
                return
            mig_uuid = dev.uuid
            if not mig_uuid:  # interrupted between create and checkpoint: ask the live inventory
                if not self.inventory.live:
                    raise DeviceError(
                        f"cannot tell whether MIG device {dev.device} was created before the "
                        "interruption until discovery's inventory arrives; will retry"
                    )
                live = self._live_mig(dev.device)
                mig_uuid = live.uuid if live is not None else ""
            if not mig_uuid:
                return
            with tracer.start_as_current_span("device.mig-destroy"):
                await self.ops.mig_destroy(dev.parent_uuid, mig_uuid)
                # a retried prepare plans from the inventory right after this undo (`claimstate`): one
                # still showing the device would pass it off as a static MIG device that exists
                if not await self.inventory.wait_mig(mig_uuid, present=False):
                    raise DeviceError(
                        f"MIG device {dev.device} ({mig_uuid}) was destroyed but discovery's "
                        "inventory still shows it; will retry"
                    )

    def _live_mig(self, name: str) -> MigDevice | None:
        """MIG device `name` as discovery's inventory shows it now; None when it does not exist."""
        try:
            return self.inventory.resolve(name).mig
        except DeviceError:
            return None
