"""NVLink partitions for claims (Fabric Manager's shared NVSwitch mode): the partition a claim's whole GPUs
form, its activation through discovery before the claim's devices are set up, and its deactivation after
the last claim that uses it.

Only a node whose discovery lists partitions (`--fabric-manager-partitions`) is concerned. There a claim's
whole GPUs (full or passthrough; MIG devices and admin-access devices do not count) must be exactly one
partition, as NVIDIA's driver requires: GPUs that span two partitions, or only part of one, are refused
before any side effect. The users of a partition are counted over the checkpoint's records (prepared, or
being prepared), as the shared MPS daemons are: a restart neither deactivates a partition in use nor
keeps one unused. Crash safety: a claim's record names its partition (`fabric_partition`) and is on disk
before the activation request (the driver yields it to the claim state machine first), so a crash or failure from there
on leaves the partition to the undo. Both requests are idempotent in discovery (it asks Fabric Manager for the state
first).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable

from services.preparer.host.checkpoint import ClaimRecord
from services.preparer.host.devices import DeviceOps, Inventory, ResolvedDevice
from services.preparer.host.port import ClaimRecords, PrepareFailed
from shared.logs import get_logger
from shared.nvlinkpartitions import PartitionError, claim_partition
from shared.telemetry import get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)


def whole_gpus(devices: Iterable[tuple[ResolvedDevice, bool]]) -> set[str]:
    """The GPUs (gpu-<minor>) a claim holds whole, from (resolved device, admin access) pairs."""
    return {r.gpu.name for r, admin in devices if r.kind in ("gpu", "vfio") and r.gpu is not None and not admin}


class Partitions:
    def __init__(self, ops: DeviceOps, records: ClaimRecords, inventory: Inventory) -> None:
        self.ops = ops
        self.records = records
        self.inventory = inventory
        self._locks: dict[int, asyncio.Lock] = defaultdict(asyncio.Lock)  # activation and release per partition

    def plan(self, gpus: set[str]) -> int:
        """The id of the partition the claim's whole GPUs form; -1 when none is needed. PrepareFailed when
        they form none (invalid-config) or Fabric Manager was away at discovery's last scan (device-error)."""
        inv = self.inventory.current
        try:
            partition = claim_partition(inv, gpus)
        except PartitionError as exc:
            away = inv is not None and inv.fabric_manager is not None and not inv.fabric_manager.partitions
            raise PrepareFailed(str(exc), "device-error" if away else "invalid-config") from None
        return partition.id if partition is not None else -1

    async def activate(self, uid: str, partition: int, gpus: set[str]) -> None:
        """Activate the claim's partition, whose record the caller has on disk (module doc)."""
        async with self._locks[partition]:
            with tracer.start_as_current_span("device.partition-activate") as span:
                span.set_attribute("dra.partition", partition)
                reply = await self.ops.partition_activate(partition, sorted(gpus))
        log.info(
            "NVLink partition ready for claim",
            claim_uid=uid,
            partition=partition,
            gpus=sorted(gpus),
            activated=reply.activated,
        )

    async def release(self, uid: str, record: ClaimRecord) -> None:
        """Deactivate the record's partition when no other claim's record names it."""
        partition = record.fabric_partition
        if partition < 0:
            return
        async with self._locks[partition]:
            users = [u for u, r in self.records.claims.items() if u != uid and r.fabric_partition == partition]
            if users:
                log.info(
                    "NVLink partition kept: other claims use it", claim_uid=uid, partition=partition, users=len(users)
                )
                return
            with tracer.start_as_current_span("device.partition-deactivate") as span:
                span.set_attribute("dra.partition", partition)
                await self.ops.partition_deactivate(partition)
