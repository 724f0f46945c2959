"""Bus request/reply handlers for device operations the preparer asks of discovery.

Owns validation against the current inventory, serialising operations (one at a time per node),
mapping NVML failures to typed DeviceOpError replies, and a re-scan after each change so the
inventory event follows before the reply.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from services.discovery.fabric import FabricError, FabricPartitions
from services.discovery.mps import MpsManager
from services.discovery.nvml import NO_ID, Nvml, NvmlOpError, RawEvent
from services.discovery.timeslice import Timeslices
from shared.drivertools import ToolError
from shared.events import catalog
from shared.events.devices import (
    DeviceOpError,
    InjectXidReply,
    InjectXidRequest,
    MigCreateReply,
    MigCreateRequest,
    MigDestroyReply,
    MigDestroyRequest,
    MpsStartReply,
    MpsStartRequest,
    MpsStopReply,
    MpsStopRequest,
    PartitionActivateReply,
    PartitionActivateRequest,
    PartitionDeactivateReply,
    PartitionDeactivateRequest,
    SetSharingReply,
    SetSharingRequest,
)
from shared.events.inventory import FabricPartition, NodeInventory
from shared.logs import get_logger

if TYPE_CHECKING:
    from services.discovery.healthevents import HealthMonitor
    from shared.bus import Bus

log = get_logger(__name__)


_TOOL_CODES = {"missing": "not-supported", "failed": "tool-failed", "timeout": "timeout"}


def _err(exc: BaseException) -> DeviceOpError:
    if isinstance(exc, NvmlOpError | FabricError):
        return DeviceOpError(code=exc.code, message=str(exc))
    if isinstance(exc, ToolError):
        return DeviceOpError(code=_TOOL_CODES.get(exc.kind, "tool-failed"), message=str(exc))
    return DeviceOpError(code="nvml-error", message=f"{type(exc).__name__}: {exc}")


class Operations:
    def __init__(
        self,
        node: str,
        nvml: Nvml,
        mps: MpsManager,
        timeslices: Timeslices,
        health: HealthMonitor | None,
        inventory: Callable[[], NodeInventory | None],
        rescan: Callable[[], Awaitable[NodeInventory]],
        fabric: FabricPartitions | None = None,
    ):
        self.node = node
        self.fabric = fabric
        self.nvml = nvml
        self.mps = mps
        self.timeslices = timeslices
        self.health = health
        self._inventory = inventory
        self._rescan = rescan
        self._lock = asyncio.Lock()
        self._subscriptions: list[Any] = []
        self._revivals: set[asyncio.Task[None]] = set()
        mps.on_exit = self._daemon_exited

    def _daemon_exited(self, daemon_id: str, pid: int) -> None:
        task = asyncio.create_task(self._revive(daemon_id, pid), name=f"mps-revive-{daemon_id}")
        self._revivals.add(task)
        task.add_done_callback(self._revivals.discard)

    async def _revive(self, daemon_id: str, pid: int) -> None:
        """An MPS daemon exited unasked: started again (or given up) under the operations' lock, then published."""
        async with self._lock:
            try:
                changed = await self.mps.revive(daemon_id, pid)
            except Exception as exc:  # noqa: BLE001 - the next share's start tries again
                log.error("MPS daemon revival failed", daemon=daemon_id, error=str(exc))
                changed = True
            if changed:
                await self._safe_rescan()

    async def serve(self, bus: Bus) -> None:
        """Answer this node's device-operation subjects until `close`."""
        for entry, handler in (
            (catalog.DEVICE_SET_SHARING, self.set_sharing),
            (catalog.DEVICE_MIG_CREATE, self.mig_create),
            (catalog.DEVICE_MIG_DESTROY, self.mig_destroy),
            (catalog.DEVICE_MPS_START, self.mps_start),
            (catalog.DEVICE_MPS_STOP, self.mps_stop),
            (catalog.DEVICE_PARTITION_ACTIVATE, self.partition_activate),
            (catalog.DEVICE_PARTITION_DEACTIVATE, self.partition_deactivate),
            (catalog.DEVICE_INJECT_XID, self.inject_xid),
        ):
            self._subscriptions.append(await bus.serve(entry, handler, node=self.node))

    async def close(self) -> None:
        """Stop answering: a stopped service must not take requests on a closed NVML handle."""
        subscriptions, self._subscriptions = self._subscriptions, []
        self.mps.close()
        for task in list(self._revivals):
            task.cancel()
        for sub in subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _inv(self) -> NodeInventory:
        inv = self._inventory()
        if inv is None:
            raise NvmlOpError("not-ready", "discovery has not scanned this node yet; retry")
        return inv

    def _gpu_uuids(self) -> set[str]:
        return {g.uuid for g in self._inv().gpus}

    async def set_sharing(self, req: SetSharingRequest) -> SetSharingReply:
        async with self._lock:
            try:
                known = self._gpu_uuids()
                unknown = [u for u in req.gpu_uuids if u not in known]
                if unknown:
                    raise NvmlOpError("not-found", f"no GPUs with UUIDs {unknown} on node {self.node}")
                for u in req.gpu_uuids:
                    await self.nvml.call(self.nvml.set_compute_mode, u, req.compute_mode)
                    await self.timeslices.set(u, req.timeslice)
            except Exception as exc:
                return SetSharingReply(ok=False, error=_err(exc))
            finally:
                await self._safe_rescan()
            return SetSharingReply(ok=True)

    async def mig_create(self, req: MigCreateRequest) -> MigCreateReply:
        async with self._lock:
            try:
                gpu = next((g for g in self._inv().gpus if g.uuid == req.gpu_uuid), None)
                if gpu is None:
                    raise NvmlOpError("not-found", f"no GPU with UUID {req.gpu_uuid} on node {self.node}")
                if not gpu.mig_capable:
                    raise NvmlOpError("not-supported", f"{gpu.name} ({gpu.product_name}) is not MIG-capable")
                prof = next((p for p in gpu.mig_profiles if p.name == req.profile), None)
                if prof is None:
                    raise NvmlOpError(
                        "invalid-argument",
                        f"{gpu.product_name} has no MIG profile {req.profile!r}; "
                        f"valid: {', '.join(p.name for p in gpu.mig_profiles)}",
                    )
                pl = next((p for p in prof.placements if p.start == req.placement.start), None)
                if pl is None or (req.placement.size and req.placement.size != pl.size):
                    raise NvmlOpError(
                        "invalid-argument",
                        f"placement {req.placement.start}+{req.placement.size} is "
                        f"not valid for {prof.name}; valid: "
                        f"{[f'{p.start}+{p.size}' for p in prof.placements]}",
                    )
                facts, created = await self.nvml.call(self.nvml.create_mig, gpu.uuid, prof.gi_profile_id, pl.start)
            except Exception as exc:
                return MigCreateReply(ok=False, error=_err(exc))
            inv = await self._safe_rescan()
            dev = None
            for g in inv.gpus if inv else []:
                dev = next((m for m in g.mig_devices if m.uuid == facts.uuid), None) or dev
            if dev is None:
                return MigCreateReply(
                    ok=False,
                    error=DeviceOpError(
                        code="nvml-error", message=f"MIG device {facts.uuid} was created but is not in the inventory"
                    ),
                )
            log.info("MIG device ready", node=self.node, device=dev.name, uuid=dev.uuid, created=created)
            return MigCreateReply(ok=True, device=dev, created=created)

    async def mig_destroy(self, req: MigDestroyRequest) -> MigDestroyReply:
        async with self._lock:
            try:
                if req.gpu_uuid not in self._gpu_uuids():
                    raise NvmlOpError("not-found", f"no GPU with UUID {req.gpu_uuid} on node {self.node}")
                destroyed = await self.nvml.call(self.nvml.destroy_mig, req.gpu_uuid, req.mig_uuid)
            except Exception as exc:
                return MigDestroyReply(ok=False, error=_err(exc))
            await self._safe_rescan()
            return MigDestroyReply(ok=True, destroyed=destroyed)

    async def mps_start(self, req: MpsStartRequest) -> MpsStartReply:
        async with self._lock:
            try:
                parents = {m.uuid: g.uuid for g in self._inv().gpus for m in g.mig_devices}
                d = await self.mps.start(req, self._gpu_uuids(), parents)
            except Exception as exc:
                return MpsStartReply(ok=False, error=_err(exc))
            await self._safe_rescan()
            return MpsStartReply(ok=True, pipe_dir=d.pipe_dir, shm_dir=d.shm_dir, log_dir=d.log_dir)

    async def mps_stop(self, req: MpsStopRequest) -> MpsStopReply:
        async with self._lock:
            try:
                stopped = await self.mps.stop(req.daemon_id)
            except Exception as exc:
                return MpsStopReply(ok=False, error=_err(exc))
            await self._safe_rescan()
            return MpsStopReply(ok=True, stopped=stopped)

    async def _partition(self, partition_id: int) -> tuple[FabricPartitions, FabricPartition]:
        """Fabric Manager's partition as it stands now (asked, not the last scan's)."""
        if self.fabric is None:
            raise NvmlOpError(
                "not-supported",
                f"NVLink partitions are off on node {self.node}: discovery runs without --fabric-manager-partitions",
            )
        state = await self.fabric.read((g.name, g.pci_bus_id, g.module_id) for g in self._inv().gpus)
        partition = next((p for p in state.partitions if p.id == partition_id), None)
        if partition is None:
            raise NvmlOpError("not-found", f"Fabric Manager on node {self.node} has no partition {partition_id}")
        return self.fabric, partition

    async def partition_activate(self, req: PartitionActivateRequest) -> PartitionActivateReply:
        async with self._lock:
            try:
                fabric, partition = await self._partition(req.partition_id)
                if partition.devices != frozenset(req.devices) or not all(g.device for g in partition.gpus):
                    raise NvmlOpError(
                        "invalid-argument",
                        f"partition {req.partition_id} holds "
                        f"{sorted(partition.devices)}, not the claim's GPUs {sorted(req.devices)}",
                    )
                if partition.active:
                    return PartitionActivateReply(ok=True, activated=False)
                await fabric.client.activate(req.partition_id)
            except Exception as exc:
                return PartitionActivateReply(ok=False, error=_err(exc))
            await self._safe_rescan()
            log.info(
                "NVLink partition activated", node=self.node, partition=req.partition_id, gpus=sorted(partition.devices)
            )
            return PartitionActivateReply(ok=True, activated=True)

    async def partition_deactivate(self, req: PartitionDeactivateRequest) -> PartitionDeactivateReply:
        async with self._lock:
            try:
                fabric, partition = await self._partition(req.partition_id)
                if not partition.active:
                    return PartitionDeactivateReply(ok=True, deactivated=False)
                await fabric.client.deactivate(req.partition_id)
            except Exception as exc:
                return PartitionDeactivateReply(ok=False, error=_err(exc))
            await self._safe_rescan()
            log.info("NVLink partition deactivated", node=self.node, partition=req.partition_id)
            return PartitionDeactivateReply(ok=True, deactivated=True)

    def _resolve(self, ref: str) -> str:
        """A device name (`gpu-0`, a MIG name) or UUID → UUID."""
        for g in self._inv().gpus:
            if ref in (g.uuid, g.name):
                return g.uuid
            for m in g.mig_devices:
                if ref in (m.uuid, m.name):
                    return m.uuid
        raise NvmlOpError("not-found", f"no device {ref!r} on node {self.node}")

    async def inject_xid(self, req: InjectXidRequest) -> InjectXidReply:
        try:
            if self.health is None:
                raise NvmlOpError("not-ready", "health monitoring is not running")
            uuid = self._resolve(req.gpu_uuid)
            if req.recover:
                await self.health.recover(uuid)
                return InjectXidReply(ok=True)
            if not req.gpu_lost and req.xid <= 0:
                raise NvmlOpError("invalid-argument", "give an XID > 0, or gpu_lost, or recover")
            reached = await self.nvml.call(self.nvml.inject_event, uuid, req.xid, req.gpu_lost)
            if not reached:  # real NVML, or no event set listening: feed the health pipeline directly
                kind = 0x4000 if req.gpu_lost else 0x8
                await self.health.handle(RawEvent(uuid, kind, req.xid, NO_ID, NO_ID))
        except Exception as exc:
            return InjectXidReply(ok=False, error=_err(exc))
        return InjectXidReply(ok=True)

    async def _safe_rescan(self) -> NodeInventory | None:
        try:
            return await self._rescan()
        except Exception as exc:
            log.exception("re-scan after device operation failed", error=str(exc))
            return self._inventory()
