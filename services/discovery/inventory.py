"""NVML facts → NodeInventory: device names, semver versions, topology, MIG tables and content hash.

Owns the naming rules (`gpu-<minor>`, `gpu-<minor>-mig-<profile>-<giProfileId>-<start>`) and the
stable content hash that decides whether an inventory is new. Pure functions; no NVML calls.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import msgspec
import pynvml as N

from services.discovery import devtree
from services.discovery.nvml import GpuFacts, NodeFacts
from services.discovery.topology import normalise_bus_id, pci_topology
from shared.devicemodel import gpu_name, mig_name
from shared.events.inventory import (
    FabricInfo,
    FabricManagerState,
    Gpu,
    MigDevice,
    MigPlacement,
    MigProfile,
    NodeInventory,
    Sharing,
)

ARCHITECTURES = {
    N.NVML_DEVICE_ARCH_KEPLER: "Kepler",
    N.NVML_DEVICE_ARCH_MAXWELL: "Maxwell",
    N.NVML_DEVICE_ARCH_PASCAL: "Pascal",
    N.NVML_DEVICE_ARCH_VOLTA: "Volta",
    N.NVML_DEVICE_ARCH_TURING: "Turing",
    N.NVML_DEVICE_ARCH_AMPERE: "Ampere",
    N.NVML_DEVICE_ARCH_ADA: "Ada Lovelace",
    N.NVML_DEVICE_ARCH_HOPPER: "Hopper",
    N.NVML_DEVICE_ARCH_BLACKWELL: "Blackwell",
}
BRANDS = {
    N.NVML_BRAND_UNKNOWN: "Unknown",
    N.NVML_BRAND_QUADRO: "Quadro",
    N.NVML_BRAND_TESLA: "Tesla",
    N.NVML_BRAND_NVS: "NVS",
    N.NVML_BRAND_GRID: "Grid",
    N.NVML_BRAND_GEFORCE: "GeForce",
    N.NVML_BRAND_TITAN: "Titan",
    N.NVML_BRAND_NVIDIA_VAPPS: "NvidiaVApps",
    N.NVML_BRAND_NVIDIA_VPC: "NvidiaVPC",
    N.NVML_BRAND_NVIDIA_VCS: "NvidiaVCS",
    N.NVML_BRAND_NVIDIA_VWS: "NvidiaVWS",
    N.NVML_BRAND_NVIDIA_CLOUD_GAMING: "NvidiaCloudGaming",
    N.NVML_BRAND_QUADRO_RTX: "QuadroRTX",
    N.NVML_BRAND_NVIDIA_RTX: "NvidiaRTX",
    N.NVML_BRAND_NVIDIA: "Nvidia",
    N.NVML_BRAND_GEFORCE_RTX: "GeForceRTX",
    N.NVML_BRAND_TITAN_RTX: "TitanRTX",
}
ADDRESSING = {
    N.NVML_DEVICE_ADDRESSING_MODE_NONE: "None",
    N.NVML_DEVICE_ADDRESSING_MODE_HMM: "HMM",
    N.NVML_DEVICE_ADDRESSING_MODE_ATS: "ATS",
}
COMPUTE_MODE_NAMES = {
    N.NVML_COMPUTEMODE_DEFAULT: "Default",
    N.NVML_COMPUTEMODE_PROHIBITED: "Prohibited",
    N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "ExclusiveProcess",
    N.NVML_COMPUTEMODE_EXCLUSIVE_THREAD: "ExclusiveProcess",
}
TIMESLICE_NAMES = {0: "Default", 1: "Short", 2: "Medium", 3: "Long"}
FABRIC_STATES = {
    N.NVML_GPU_FABRIC_STATE_NOT_STARTED: "not-started",
    N.NVML_GPU_FABRIC_STATE_IN_PROGRESS: "in-progress",
    N.NVML_GPU_FABRIC_STATE_COMPLETED: "completed",
}
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def semver(version: str) -> str:
    """`550.163.01` → `550.163.1`, `12.4` → `12.4.0` (leading zeros dropped, three components)."""
    parts = [str(int(p)) for p in re.findall(r"\d+", version)[:3]]
    while len(parts) < 3:
        parts.append("0")
    return ".".join(parts)


def cuda_semver(value: int) -> str:
    """nvmlSystemGetCudaDriverVersion's 12040 → `12.4.0`."""
    return f"{value // 1000}.{(value % 1000) // 10}.0"


def content_hash(inv: NodeInventory) -> str:
    """A stable hash over the inventory, excluding observed_at and content_hash."""
    body = msgspec.structs.replace(inv, content_hash="", observed_at=0.0)
    return hashlib.sha256(msgspec.json.encode(body)).hexdigest()[:32]


def _cap_minors(dev_root: Path) -> dict[str, int]:
    try:
        text = (dev_root / "proc" / "driver" / "nvidia-caps" / "mig-minors").read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, minor = line.rpartition(" ")
        if key and minor.isdigit():
            out[key] = int(minor)
    return out


def _caps(minors: dict[str, int], gpu_minor: int, gi: int, ci: int) -> list[str]:
    a = minors.get(f"gpu{gpu_minor}/gi{gi}/access")
    b = minors.get(f"gpu{gpu_minor}/gi{gi}/ci{ci}/access")
    if a is None or b is None:
        a, b = devtree.mig_cap_minors(gpu_minor, gi, ci)
    return [f"/dev/nvidia-caps/nvidia-cap{a}", f"/dev/nvidia-caps/nvidia-cap{b}"]


def _gpu(g: GpuFacts, dev_root: Path, sys_root: Path, minors: dict[str, int], mps: dict[str, str]) -> Gpu:
    bus = normalise_bus_id(g.bus_id)
    root, numa = pci_topology(sys_root, bus)
    if numa < 0 and g.numa_node is not None:
        numa = g.numa_node
    profiles = [
        MigProfile(
            name=p.name,
            gi_profile_id=p.gi_profile_id,
            ci_profile_id=p.ci_profile_id,
            slice_count=p.slices,
            memory_mib=p.memory_mib,
            multiprocessors=p.sms,
            copy_engines=p.ce,
            decoders=p.dec,
            encoders=p.enc,
            jpeg_engines=p.jpeg,
            ofa_engines=p.ofa,
            placements=[MigPlacement(start=s, size=z) for s, z in p.placements],
        )
        for p in g.profiles
    ]
    by_id = {p.gi_profile_id: p for p in profiles}
    devices: list[MigDevice] = []
    for m in sorted(g.mig, key=lambda m: (m.start, m.gi_profile_id)):
        p = by_id.get(m.gi_profile_id)
        if p is None:
            continue  # a GI profile NVML no longer lists; skip rather than guess its capacity
        devices.append(
            MigDevice(
                name=mig_name(g.minor, p.name, m.gi_profile_id, m.start),
                uuid=m.uuid,
                profile=p.name,
                gi_profile_id=m.gi_profile_id,
                placement=MigPlacement(start=m.start, size=m.size),
                gpu_instance_id=m.gi_id,
                compute_instance_id=m.ci_id,
                memory_mib=p.memory_mib,
                multiprocessors=p.multiprocessors,
                copy_engines=p.copy_engines,
                decoders=p.decoders,
                encoders=p.encoders,
                jpeg_engines=p.jpeg_engines,
                ofa_engines=p.ofa_engines,
                device_path_caps=_caps(minors, g.minor, m.gi_id, m.ci_id),
                mps_daemon=mps.get(m.uuid, ""),
            )
        )
    fabric = None
    if g.fabric is not None:
        fabric = FabricInfo(
            cluster_uuid=g.fabric.cluster_uuid,
            clique_id=g.fabric.clique_id,
            state=FABRIC_STATES.get(g.fabric.state, "unknown"),
        )
    return Gpu(
        name=gpu_name(g.minor),
        index=g.index,
        minor=g.minor,
        uuid=g.uuid,
        product_name=g.name,
        brand=BRANDS.get(g.brand, "Unknown"),
        architecture=ARCHITECTURES.get(g.architecture, "Unknown"),
        cuda_compute_capability=semver(f"{g.cc[0]}.{g.cc[1]}"),
        memory_bytes=g.memory_total or 0,
        pci_bus_id=bus,
        pcie_root=root,
        numa_node=numa,
        addressing_mode=ADDRESSING.get(g.addressing_mode, "") if g.addressing_mode is not None else "",
        mig_capable=g.mig_capable,
        mig_enabled=g.mig_enabled,
        memory_slice_count=max((p.start + p.size for pr in profiles for p in pr.placements), default=0),
        mig_profiles=profiles,
        mig_devices=devices,
        fabric=fabric,
        sharing=Sharing(
            compute_mode=COMPUTE_MODE_NAMES.get(g.compute_mode or 0, "Default"),
            timeslice=TIMESLICE_NAMES.get(g.timeslice or 0, "Default"),
            mps_daemon=mps.get(g.uuid, ""),
        ),
        device_path=f"/dev/nvidia{g.minor}",
        module_id=g.module_id or 0,
    )


def build(
    node: str,
    facts: NodeFacts,
    *,
    dev_root: Path,
    sys_root: Path,
    simulated: bool,
    mps: dict[str, str] | None = None,
    observed_at: float = 0.0,
    features: dict[str, bool] | None = None,
    fabric: FabricManagerState | None = None,
) -> NodeInventory:
    """The NodeInventory for `facts` (and Fabric Manager's partitions, when asked for), with content_hash set;
    `features`: the node's feature gates."""
    minors = _cap_minors(dev_root)
    gpus = sorted((_gpu(g, dev_root, sys_root, minors, mps or {}) for g in facts.gpus), key=lambda g: g.minor)
    inv = NodeInventory(
        node=node,
        driver_version=semver(facts.driver_version),
        cuda_driver_version=cuda_semver(facts.cuda_version),
        gpus=gpus,
        control_device_paths=[p for p in CONTROL_DEVICES if (dev_root / p.lstrip("/")).exists()],
        dev_root=str(dev_root),
        simulated=simulated,
        features=dict(features or {}),
        fabric_manager=fabric,
    )
    inv.content_hash = content_hash(inv)
    inv.observed_at = observed_at
    return inv
