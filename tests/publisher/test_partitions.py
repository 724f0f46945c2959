"""NVLink partitions as device attributes: `partition<N>` (the id of the N-GPU partition holding the GPU) and
`gpuModuleID`, as NVIDIA's driver names them, on whole GPUs and their VFIO twins; none on a node without them."""

from __future__ import annotations

from pathlib import Path

from embedded.harness.discovery import running_discovery
from services.publisher import slices
from shared.bus import Bus
from tests.publisher.test_slices import V135, assert_valid, bodies


def attrs(pool: slices.DesiredPool) -> dict[str, dict]:
    return {d["name"]: d["attributes"] for s in pool.slices for d in s.devices}


async def test_each_gpu_names_the_partition_of_each_size_that_holds_it(bus: Bus, tmp_path: Path) -> None:
    async with running_discovery(
        bus,
        node="n1",
        simulate="h100x8",
        root=tmp_path / "sim",
        fabric_manager_partitions=True,
        feature_gates="PassthroughSupport=true,FabricManagerPartitioning=true",
    ) as disc:
        inv = disc.inventory
    pool = slices.desired_pools(inv, {}, slices.SliceOptions(passthrough=True), V135)[slices.GPU_DRIVER]
    devices = attrs(pool)
    for name in ("gpu-5", "gpu-vfio-5"):
        got = {k: v for k, v in devices[name].items() if k.startswith(("partition", "gpuModuleID"))}
        assert got == {
            "partition8": {"int": 0},
            "partition4": {"int": 2},
            "partition2": {"int": 5},
            "partition1": {"int": 12},
            "gpuModuleID": {"int": 6},
        }
    pairs: dict[int, list[str]] = {}
    for name, a in devices.items():
        if name.startswith("gpu-") and not name.startswith("gpu-vfio"):
            pairs.setdefault(a["partition2"]["int"], []).append(name)
    assert sorted(pairs.values()) == [["gpu-0", "gpu-1"], ["gpu-2", "gpu-3"], ["gpu-4", "gpu-5"], ["gpu-6", "gpu-7"]]
    for body in bodies(pool, V135):
        assert_valid(body)


async def test_no_partition_attributes_without_fabric_manager(bus: Bus, tmp_path: Path) -> None:
    async with running_discovery(bus, node="n1", simulate="h100x8", root=tmp_path / "sim") as disc:
        inv = disc.inventory
    pool = slices.desired_pools(inv, {}, slices.SliceOptions(), V135)[slices.GPU_DRIVER]
    assert not any(k.startswith(("partition", "gpuModuleID")) for a in attrs(pool).values() for k in a)
