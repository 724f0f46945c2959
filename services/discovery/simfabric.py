"""The simulated Fabric Manager of a simulated node: shared NVSwitch partitions, kept in a state file.

Answers the calls `fabric.FabricManagerClient` makes, in-process, as Fabric Manager does: the partition
list, activate (refused when the partition, or one sharing a GPU with it, is active), deactivate
(refused when it is not active). The partitions are made once per node from its GPUs in module-id order,
as an HGX baseboard's default table: the whole board, then halves, quarters, ... down to single GPUs
(8 GPUs: id 0 holds all 8, ids 1-2 four each, 3-6 two each, 7-14 one each). The state lives beside the
simulated NVML's (`<state dir>/simfabric-<node>.json`), so a restarted discovery finds its partitions
still active, as on a node where Fabric Manager keeps running.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from services.discovery.fabric import FabricError, FmGpu, FmPartition, FmPartitionList
from services.discovery.nvml import Nvml
from shared.files import atomic_write

NVLINKS = 18  # an H100 SXM's NVLinks
LINE_RATE_MBPS = 50_000


def state_file(state_dir: str | Path, node: str) -> Path:
    return Path(state_dir) / f"simfabric-{node}.json"


def default_partitions(gpus: list[FmGpu]) -> list[FmPartition]:
    """The baseboard's table for `gpus` (module-id order): every size dividing the count, largest first."""
    count = len(gpus)
    sizes = sorted({count, *(s for s in (8, 4, 2, 1) if s <= count and count % s == 0)}, reverse=True)
    out: list[FmPartition] = []
    for size in sizes:
        for start in range(0, count, size):
            out.append(FmPartition(partition_id=len(out), gpu_info=gpus[start : start + size]))
    return out


class SimFabricManager:
    """Fabric Manager for a node whose NVML is simulated."""

    def __init__(self, nvml: Nvml, path: Path):
        self.nvml = nvml
        self.path = path
        self._lock = asyncio.Lock()

    async def _load(self) -> list[FmPartition]:
        def read() -> bytes | None:
            return self.path.read_bytes() if self.path.exists() else None

        raw = await asyncio.to_thread(read)
        if raw is not None:
            return msgspec.json.decode(raw, type=FmPartitionList).partition_info
        facts = await self.nvml.call(self.nvml.read)
        gpus = [
            FmGpu(
                physical_id=g.module_id or g.index + 1,
                uuid=g.uuid,
                pci_bus_id=g.bus_id,
                nvlinks_available=NVLINKS,
                max_nvlinks=NVLINKS,
                line_rate_mbps=LINE_RATE_MBPS,
            )
            for g in sorted(facts.gpus, key=lambda g: g.module_id or g.index + 1)
        ]
        partitions = default_partitions(gpus)
        await self._save(partitions)
        return partitions

    async def _save(self, partitions: list[FmPartition]) -> None:
        data = msgspec.json.encode(FmPartitionList(partition_info=partitions))
        await asyncio.to_thread(self.path.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(atomic_write, self.path, data)

    async def partitions(self) -> list[FmPartition]:
        async with self._lock:
            return await self._load()

    async def _set(self, partition_id: int, active: bool) -> None:
        async with self._lock:
            partitions = await self._load()
            target = next((p for p in partitions if p.partition_id == partition_id), None)
            if target is None:
                raise FabricError("not-found", f"Fabric Manager has no partition {partition_id}")
            if bool(target.is_active) == active:
                raise FabricError(
                    "fabric-manager-error",
                    f"partition {partition_id} is "
                    f"{'already active' if active else 'not active'} (simulated Fabric Manager)",
                )
            if active:
                modules = {g.physical_id for g in target.gpu_info}
                busy = [
                    p.partition_id for p in partitions if p.is_active and modules & {g.physical_id for g in p.gpu_info}
                ]
                if busy:
                    raise FabricError(
                        "fabric-manager-error",
                        f"partition {partition_id} shares GPUs with active "
                        f"partition(s) {busy} (simulated Fabric Manager: in use)",
                    )
            target.is_active = int(active)
            await self._save(partitions)

    async def activate(self, partition_id: int) -> None:
        await self._set(partition_id, True)

    async def deactivate(self, partition_id: int) -> None:
        await self._set(partition_id, False)
