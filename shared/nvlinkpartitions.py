"""NVLink partitions (Fabric Manager's shared NVSwitch mode) as devices see them: the attributes a GPU
publishes, and the one partition a claim's GPUs must form.

Attribute names follow NVIDIA's driver (FabricManagerPartitioning): `gpuModuleID` (int) and, for each
partition size N that holds the GPU, `partition<N>` = that partition's id (int). So a claim's constraint
`matchAttribute: gpu.nvidia.com/partition2` with a count of 2 gets both GPUs of one 2-GPU partition. A size
at which the GPU is in two partitions (a table Fabric Manager should never list) publishes neither.
Pure functions over the inventory: the publisher and the preparer read the same facts.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from shared.events.inventory import FabricPartition, Gpu, NodeInventory

MODULE_ID = "gpuModuleID"


def partition_attribute(size: int) -> str:
    return f"partition{size}"


def partitions_by_size(device: str, inv: NodeInventory) -> dict[int, int]:
    """{partition size: partition id} of the partitions holding `device` (gpu-<minor>), unambiguous sizes only."""
    if inv.fabric_manager is None:
        return {}
    found: dict[int, list[int]] = defaultdict(list)
    for p in inv.fabric_manager.partitions:
        if device in p.devices:
            found[len(p.gpus)].append(p.id)
    return {size: ids[0] for size, ids in found.items() if len(ids) == 1}


def attributes(gpu: Gpu, inv: NodeInventory) -> dict[str, Any]:
    """A whole GPU's partition attributes (none when the node does not use Fabric Manager partitions)."""
    by_size = partitions_by_size(gpu.name, inv)
    if not by_size:
        return {}
    attrs: dict[str, Any] = {partition_attribute(size): {"int": pid} for size, pid in sorted(by_size.items())}
    if gpu.module_id:
        attrs[MODULE_ID] = {"int": gpu.module_id}
    return attrs


class PartitionError(ValueError):
    """A claim's GPUs cannot be given one partition; the message says why and what to ask for instead."""


def claim_partition(inv: NodeInventory | None, devices: set[str]) -> FabricPartition | None:
    """The partition whose GPUs are exactly `devices` (a claim's whole GPUs, by name), as NVIDIA's driver
    requires; None when the node does not use partitions or the claim has no whole GPU. PartitionError when
    the GPUs form no partition (they span two, or are part of a larger one) or Fabric Manager is away."""
    if inv is None or inv.fabric_manager is None or not devices:
        return None
    fm = inv.fabric_manager
    if fm.error and not fm.partitions:
        raise PartitionError(
            f"node {inv.node} uses NVLink partitions, and Fabric Manager could not be asked at "
            f"discovery's last scan: {fm.error}"
        )
    for p in fm.partitions:
        if p.devices == devices:
            return p
    where = []
    for device in sorted(devices):
        holding = sorted((p for p in fm.partitions if device in p.devices), key=lambda p: (len(p.gpus), p.id))
        where.append(
            f"{device} in partition {holding[0].id} ({len(holding[0].gpus)} GPU(s))" if holding else f"{device} in none"
        )
    raise PartitionError(
        f"the claim's GPUs {', '.join(sorted(devices))} do not form one NVLink partition of Fabric Manager "
        f"(smallest: {'; '.join(where)}); ask for GPUs of one partition with the constraint `matchAttribute: "
        f"gpu.nvidia.com/{partition_attribute(len(devices))}`"
    )
