"""How an inventory's GPUs appear as DRA devices: names, attributes, capacities and counters.

Owns the upstream device model (driver `gpu.nvidia.com`): device names, attribute keys and value
types, capacities as Kubernetes quantities, and the partitionable (dynamic MIG) counter layout.
Output is `resource.k8s.io/v1` device dicts; the publisher decides which devices go in which slice.
"""

from __future__ import annotations

import re
from typing import Any

from shared import nvlinkpartitions
from shared.events.inventory import Gpu, MigDevice, MigPlacement, MigProfile, MigResources, NodeInventory

GPU_DRIVER = "gpu.nvidia.com"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
MIG_NAME = re.compile(r"^gpu-(\d+)-mig-(.+)-(\d+)-(\d+)\Z", re.ASCII)
# Architectures whose MIG mode can be toggled without a GPU reset (full GPU stays advertisable).
RESETLESS_MIG_ARCHITECTURES = frozenset({"Hopper", "Blackwell"})

Device = dict[str, Any]
# capacity key (camelCase, in slices) -> counter name (DNS label, in counter sets)
MIG_CAPACITY_COUNTERS = {
    "multiprocessors": "multiprocessors",
    "copyEngines": "copy-engines",
    "decoders": "decoders",
    "encoders": "encoders",
    "jpegEngines": "jpeg-engines",
    "ofaEngines": "ofa-engines",
    "memory": "memory",
}
MIB = 1024 * 1024


def rfc1123_profile(profile: str) -> str:
    """`1g.10gb` -> `1g10gb`, `1g.10gb+me` -> `1g10gb-me`."""
    return re.sub(r"[^a-z0-9-]", "-", profile.lower().replace(".", "")).strip("-")


def gpu_name(minor: int) -> str:
    return f"gpu-{minor}"


def mig_name(parent_minor: int, profile: str, gi_profile_id: int, start: int) -> str:
    return f"gpu-{parent_minor}-mig-{rfc1123_profile(profile)}-{gi_profile_id}-{start}"


def counter_set_name(minor: int) -> str:
    return f"gpu-{minor}-counter-set"


def binary_si(value: int) -> str:
    """Bytes (or any count) as a canonical BinarySI quantity: 85899345920 -> `80Gi`, 14 -> `14`."""
    if value == 0:
        return "0"
    for suffix, power in (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if value % (1 << power) == 0:
            return f"{value >> power}{suffix}"
    return str(value)


def _string(value: str) -> dict[str, str]:
    return {"string": value}


def _version(value: str) -> dict[str, str]:
    return {"version": value}


def _int(value: int) -> dict[str, int]:
    return {"int": value}


def _quantity(value: int) -> dict[str, str]:
    return {"value": binary_si(value)}


def common_attributes(gpu: Gpu, inv: NodeInventory) -> dict[str, Any]:
    """Attributes a GPU and each of its MIG devices share (the parent's identity and topology)."""
    attrs: dict[str, Any] = {
        "productName": _string(gpu.product_name),
        "brand": _string(gpu.brand),
        "architecture": _string(gpu.architecture),
        "cudaComputeCapability": _version(gpu.cuda_compute_capability),
        "driverVersion": _version(inv.driver_version),
        "cudaDriverVersion": _version(inv.cuda_driver_version),
        PCI_BUS_ID: _string(gpu.pci_bus_id),
    }
    if gpu.addressing_mode:
        attrs["addressingMode"] = _string(gpu.addressing_mode)
    if gpu.pcie_root:
        attrs[PCIE_ROOT] = _string(gpu.pcie_root)
    # Topology beyond the reference driver: NUMA affinity and NVLink fabric membership.
    if gpu.numa_node >= 0:
        attrs["numaNode"] = _int(gpu.numa_node)
    if gpu.fabric is not None and gpu.fabric.cluster_uuid:
        attrs["nvlinkClusterUUID"] = _string(gpu.fabric.cluster_uuid)
        attrs["nvlinkCliqueID"] = _int(gpu.fabric.clique_id)
    return attrs


def mig_capacity(res: MigResources) -> dict[str, Any]:
    return {
        "multiprocessors": _quantity(res.multiprocessors),
        "copyEngines": _quantity(res.copy_engines),
        "decoders": _quantity(res.decoders),
        "encoders": _quantity(res.encoders),
        "jpegEngines": _quantity(res.jpeg_engines),
        "ofaEngines": _quantity(res.ofa_engines),
        "memory": _quantity(res.memory_mib * MIB),
    }


def max_mig_resources(gpu: Gpu) -> MigResources:
    """Element-wise maximum over the GPU's MIG profiles (the full GPU's dynamic-MIG capacity)."""
    profiles = gpu.mig_profiles
    return MigResources(
        memory_mib=max(p.memory_mib for p in profiles),
        multiprocessors=max(p.multiprocessors for p in profiles),
        copy_engines=max(p.copy_engines for p in profiles),
        decoders=max(p.decoders for p in profiles),
        encoders=max(p.encoders for p in profiles),
        jpeg_engines=max(p.jpeg_engines for p in profiles),
        ofa_engines=max(p.ofa_engines for p in profiles),
    )


def memory_slice_count(gpu: Gpu) -> int:
    """Memory slices as counters: the largest placement size over the profiles."""
    sizes = [pl.size for p in gpu.mig_profiles for pl in p.placements]
    return max(sizes, default=gpu.memory_slice_count)


def full_gpu_device(gpu: Gpu, inv: NodeInventory) -> Device:
    """A whole GPU in the default (non-partitionable) mode: capacity `memory` in bytes."""
    attrs = {
        "type": _string("gpu"),
        "uuid": _string(gpu.uuid),
        **common_attributes(gpu, inv),
        **nvlinkpartitions.attributes(gpu, inv),
    }
    device: Device = {"name": gpu.name, "attributes": attrs}
    if gpu.memory_bytes > 0:
        device["capacity"] = {"memory": _quantity(gpu.memory_bytes)}
    return device


def static_mig_device(gpu: Gpu, mig: MigDevice, inv: NodeInventory) -> Device:
    """A MIG device that exists now, with its UUID and the memory slices it covers."""
    attrs = {
        "type": _string("mig"),
        "uuid": _string(mig.uuid),
        "parentUUID": _string(gpu.uuid),
        "profile": _string(mig.profile),
        **common_attributes(gpu, inv),
    }
    capacity = mig_capacity(mig)
    for i in range(mig.placement.start, mig.placement.start + mig.placement.size):
        capacity[f"memorySlice{i}"] = _quantity(1)
    return {"name": mig.name, "attributes": attrs, "capacity": capacity}


def _slice_counters(placement: MigPlacement) -> dict[str, Any]:
    return {f"memory-slice-{i}": _quantity(1) for i in range(placement.start, placement.start + placement.size)}


def counter_set(gpu: Gpu) -> dict[str, Any] | None:
    """The GPU's shared counters (capacities plus memory slices); None without MIG data."""
    if not gpu.mig_profiles:
        return None
    top = mig_capacity(max_mig_resources(gpu))
    counters = {MIG_CAPACITY_COUNTERS[k]: v for k, v in top.items()}
    counters.update(_slice_counters(MigPlacement(start=0, size=memory_slice_count(gpu))))
    return {"name": counter_set_name(gpu.minor), "counters": counters}


def partitionable_gpu_device(gpu: Gpu, inv: NodeInventory) -> Device:
    """The full GPU in dynamic-MIG mode: consumes every counter, so it excludes all MIG placements."""
    device = full_gpu_device(gpu, inv)
    cs = counter_set(gpu)
    if cs is not None:
        device["capacity"] = mig_capacity(max_mig_resources(gpu))
        device["consumesCounters"] = [{"counterSet": cs["name"], "counters": dict(cs["counters"])}]
    return device


def dynamic_mig_device(gpu: Gpu, profile: MigProfile, placement: MigPlacement, inv: NodeInventory) -> Device:
    """A MIG device that can be created on demand at one placement (no UUID until it exists)."""
    attrs = {
        "type": _string("mig"),
        "parentUUID": _string(gpu.uuid),
        "profile": _string(profile.name),
        **common_attributes(gpu, inv),
    }
    capacity = mig_capacity(profile)
    counters = {MIG_CAPACITY_COUNTERS[k]: v for k, v in capacity.items()}
    counters.update(_slice_counters(placement))
    return {
        "name": mig_name(gpu.minor, profile.name, profile.gi_profile_id, placement.start),
        "attributes": attrs,
        "capacity": capacity,
        "consumesCounters": [{"counterSet": counter_set_name(gpu.minor), "counters": counters}],
    }


def supports_dynamic_mig(gpu: Gpu) -> bool:
    """MIG-capable with MIG data, and either reset-less MIG (Hopper+) or MIG already on."""
    return (
        gpu.mig_capable
        and bool(gpu.mig_profiles)
        and (gpu.architecture in RESETLESS_MIG_ARCHITECTURES or gpu.mig_enabled)
    )


def default_mode_devices(gpu: Gpu, inv: NodeInventory) -> list[Device]:
    """Default mode: the full GPU when MIG is off, else its existing MIG devices (maybe none)."""
    if gpu.mig_enabled:
        return [static_mig_device(gpu, m, inv) for m in gpu.mig_devices]
    return [full_gpu_device(gpu, inv)]


def dynamic_mode_devices(gpu: Gpu, inv: NodeInventory) -> list[Device]:
    """Dynamic MIG: the full GPU (unless MIG is on without reset-less toggling) and every placement."""
    if not supports_dynamic_mig(gpu):
        return default_mode_devices(gpu, inv)
    devices: list[Device] = []
    if not gpu.mig_enabled or gpu.architecture in RESETLESS_MIG_ARCHITECTURES:
        devices.append(partitionable_gpu_device(gpu, inv))
    for profile in gpu.mig_profiles:
        devices += [dynamic_mig_device(gpu, profile, pl, inv) for pl in profile.placements]
    return sorted(devices, key=lambda d: d["name"])


def vfio_name(minor: int) -> str:
    """A GPU offered for passthrough: `gpu-vfio-<minor>` (NVIDIA counts `gpu-vfio-<i>` in PCI order; the
    minor keeps the name of one GPU the same across rescans and restarts)."""
    return f"gpu-vfio-{minor}"


def passthrough_counter_set(gpu: Gpu) -> dict[str, Any]:
    """One counter (`gpu: 1`) that the GPU's nvidia device and its VFIO device both consume (KEP-4815), so
    the scheduler gives the GPU out one way at a time."""
    return {"name": f"gpu-{gpu.minor}-passthrough", "counters": {"gpu": _quantity(1)}}


def with_passthrough(device: Device, gpu: Gpu) -> Device:
    """`device` (the GPU's, either way) consuming the GPU's passthrough counter."""
    consumes = {"counterSet": passthrough_counter_set(gpu)["name"], "counters": {"gpu": _quantity(1)}}
    return {**device, "consumesCounters": [*device.get("consumesCounters", []), consumes]}


def vfio_device(gpu: Gpu, inv: NodeInventory) -> Device:
    """The GPU for a VM (`vfio.gpu.nvidia.com`): bound to vfio-pci when prepared. Its `uuid` is the GPU's
    NVML UUID (NVIDIA's driver makes one up from the PCI address, as NVML does not see a GPU on vfio-pci)."""
    attrs = {
        "type": _string("vfio"),
        "uuid": _string(gpu.uuid),
        **common_attributes(gpu, inv),
        **nvlinkpartitions.attributes(gpu, inv),
    }
    device: Device = {"name": vfio_name(gpu.minor), "attributes": attrs}
    if gpu.memory_bytes > 0:
        device["capacity"] = {"memory": _quantity(gpu.memory_bytes)}
    return with_passthrough(device, gpu)


def parse_mig_name(name: str) -> tuple[int, str, int, int] | None:
    """`gpu-0-mig-1g10gb-19-3` -> (0, "1g10gb", 19, 3); None for a non-MIG name."""
    m = MIG_NAME.match(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
