"""Node inventory as discovery reports it: physical GPUs, their MIG tables and live MIG devices.

Raw facts only: how devices are advertised (full GPU, static MIG, partitionable) is the
publisher's choice, and device node paths are the preparer's. Names follow upstream
(`gpu-<minor>`, `gpu-<minor>-mig-<profile>-<giProfileId>-<placementStart>`).
"""

from __future__ import annotations

import msgspec

from shared.events.base import Message


class MigPlacement(msgspec.Struct, frozen=True):
    """A GPU-instance placement: the first memory slice and how many slices it spans."""

    start: int
    size: int


class MigResources(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a MIG GPU instance holds: memory and engines (the published capacities)."""

    memory_mib: int
    multiprocessors: int
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0


class MigProfile(MigResources, kw_only=True, omit_defaults=True):
    """One row of a GPU's MIG profile table (GPU-instance profile with C == G)."""

    name: str  # e.g. "1g.10gb"
    gi_profile_id: int  # NVML GpuInstanceProfileInfo.id
    ci_profile_id: int = 0
    slice_count: int  # compute slices
    placements: list[MigPlacement] = msgspec.field(default_factory=list)


class MigDevice(MigResources, kw_only=True, omit_defaults=True):
    """A MIG device that exists now on a GPU (created statically or by the preparer)."""

    name: str  # gpu-<minor>-mig-<profile>-<gi>-<start>
    uuid: str  # MIG-...
    profile: str
    gi_profile_id: int
    placement: MigPlacement
    gpu_instance_id: int
    compute_instance_id: int
    device_path_caps: list[str] = msgspec.field(default_factory=list)  # /dev/nvidia-caps/nvidia-capN


class FabricInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """NVLink fabric membership (Multi-Node NVLink): the cluster UUID and clique id."""

    cluster_uuid: str
    clique_id: int
    state: str = "completed"


class Sharing(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The sharing state discovery has applied to a GPU."""

    compute_mode: str = "Default"  # Default | ExclusiveProcess | Prohibited
    timeslice: str = "Default"  # Default | Short | Medium | Long
    mps_daemon: str = ""  # id of the MPS control daemon serving this GPU, if any


class Gpu(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A physical GPU as NVML reports it."""

    name: str  # gpu-<minor>
    index: int
    minor: int
    uuid: str
    product_name: str
    brand: str
    architecture: str  # e.g. "Hopper"
    cuda_compute_capability: str  # semver, e.g. "9.0.0"
    memory_bytes: int
    pci_bus_id: str  # 0000:3b:00.0
    pcie_root: str = ""  # pci0000:3a
    numa_node: int = -1
    addressing_mode: str = ""  # HMM | ATS | "" (unsupported)
    mig_capable: bool = False
    mig_enabled: bool = False
    memory_slice_count: int = 0
    mig_profiles: list[MigProfile] = msgspec.field(default_factory=list)
    mig_devices: list[MigDevice] = msgspec.field(default_factory=list)
    fabric: FabricInfo | None = None
    sharing: Sharing = msgspec.field(default_factory=Sharing)
    device_path: str = ""  # /dev/nvidia<minor>


class NodeInventory(Message, kw_only=True):
    """Everything discovery knows about a node's GPUs. KV value under the node name."""

    node: str
    driver_version: str  # semver-normalised, e.g. "550.163.1"
    cuda_driver_version: str  # e.g. "12.4.0"
    gpus: list[Gpu] = msgspec.field(default_factory=list)
    control_device_paths: list[str] = msgspec.field(default_factory=list)  # /dev/nvidiactl, ...
    dev_root: str = "/"  # where the node's /dev lives (a fake tree under simulation)
    simulated: bool = False
    content_hash: str = ""  # hash of the content above; unchanged hash publishes nothing
    observed_at: float = 0.0


class InventoryWithdrawn(Message, kw_only=True):
    """Discovery on a node stopped for good (node drained or removed): its slices go."""

    node: str
    reason: str = ""
    observed_at: float = 0.0
