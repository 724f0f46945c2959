"""Node inventory as discovery reports it: physical GPUs, their MIG tables and live MIG devices.

Raw facts only: how devices are advertised (full GPU, static MIG, partitionable) is the
publisher's choice, and device node paths are the preparer's. Names follow upstream
(`gpu-<minor>`, `gpu-<minor>-mig-<profile>-<giProfileId>-<placementStart>`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.events.base import OBSERVED_AT, Message, doc


class MigPlacement(msgspec.Struct, frozen=True):
    """A GPU-instance placement: the first memory slice and how many slices it spans."""

    start: Annotated[int, doc("The first memory slice of the placement (NVML GpuInstancePlacement.start).")]
    size: Annotated[int, doc("How many memory slices the placement spans.")]


class MigResources(msgspec.Struct, kw_only=True):
    """What a MIG GPU instance holds: memory and engines (the published capacities)."""

    memory_mib: Annotated[int, doc("Framebuffer memory of the instance.", unit="MiB")]
    multiprocessors: Annotated[int, doc("Streaming multiprocessors of the instance.")]
    copy_engines: Annotated[int, doc("Copy engines of the instance.")] = 0
    decoders: Annotated[int, doc("Video decoders (NVDEC) of the instance.")] = 0
    encoders: Annotated[int, doc("Video encoders (NVENC) of the instance.")] = 0
    jpeg_engines: Annotated[int, doc("JPEG decoders of the instance.")] = 0
    ofa_engines: Annotated[int, doc("Optical-flow accelerators of the instance.")] = 0


class MigProfile(MigResources, kw_only=True):
    """One row of a GPU's MIG profile table (GPU-instance profile with C == G)."""

    name: Annotated[str, doc("The profile name, e.g. 1g.10gb or 1g.10gb+me.")]
    gi_profile_id: Annotated[int, doc("NVML GpuInstanceProfileInfo.id of the profile.")]
    ci_profile_id: Annotated[int, doc("NVML compute-instance profile id used with it.")] = 0
    slice_count: Annotated[int, doc("Compute slices the profile takes.")]
    placements: Annotated[list[MigPlacement], doc("Every placement NVML allows for the profile.")] = msgspec.field(
        default_factory=list
    )


class MigDevice(MigResources, kw_only=True):
    """A MIG device that exists now on a GPU (created statically or by the preparer)."""

    name: Annotated[str, doc("The device name, gpu-<minor>-mig-<profile>-<gi profile id>-<placement start>.")]
    uuid: Annotated[str, doc("The MIG device UUID (MIG-...).")]
    profile: Annotated[str, doc("The MIG profile name, e.g. 1g.10gb.")]
    gi_profile_id: Annotated[int, doc("NVML GPU-instance profile id.")]
    placement: Annotated[MigPlacement, doc("Where the GPU instance sits in the GPU's memory slices.")]
    gpu_instance_id: Annotated[int, doc("NVML GPU instance id.")]
    compute_instance_id: Annotated[int, doc("NVML compute instance id.")]
    device_path_caps: Annotated[list[str], doc("The /dev/nvidia-caps/nvidia-capN nodes giving access.")] = (
        msgspec.field(default_factory=list)
    )
    mps_daemon: Annotated[
        str, doc("Id of the MPS control daemon serving this MIG device (mig+mps shares); '' when none.")
    ] = ""


class FabricInfo(msgspec.Struct, kw_only=True):
    """NVLink fabric membership (Multi-Node NVLink): the cluster UUID and clique id."""

    cluster_uuid: Annotated[str, doc("The NVLink fabric cluster UUID.")]
    clique_id: Annotated[int, doc("The NVLink clique id within the cluster.")]
    state: Annotated[str, doc("The fabric registration state, as NVML reports it (completed when usable).")] = (
        "completed"
    )


class Sharing(msgspec.Struct, kw_only=True):
    """The sharing state discovery has applied to a GPU."""

    compute_mode: Annotated[str, doc("NVML compute mode: Default, ExclusiveProcess or Prohibited.")] = "Default"
    timeslice: Annotated[str, doc("Time-slice interval: Default, Short, Medium or Long.")] = "Default"
    mps_daemon: Annotated[str, doc("Id of the MPS control daemon serving this GPU; '' when none.")] = ""


class FabricPartitionGpu(msgspec.Struct, kw_only=True):
    """A GPU of a Fabric Manager partition, as Fabric Manager reports it, with its device here."""

    module_id: Annotated[int, doc("The GPU's module (physical) id on the baseboard, as Fabric Manager reports it.")]
    pci_bus_id: Annotated[str, doc("PCI bus id, normalised as Gpu.pci_bus_id, e.g. 0000:3b:00.0.")]
    uuid: Annotated[str, doc("The GPU UUID as Fabric Manager reports it; '' when it reports none.")] = ""
    device: Annotated[
        str,
        doc("The inventory's GPU it is (gpu-<minor>, matched by PCI bus id, else module id); '' when none matches."),
    ] = ""
    nvlinks_available: Annotated[int, doc("NVLinks of the GPU available to the partition.")] = 0
    max_nvlinks: Annotated[int, doc("NVLinks the GPU has.")] = 0
    nvlink_line_rate_mbps: Annotated[int, doc("NVLink line rate.", unit="MBps")] = 0


class FabricPartition(msgspec.Struct, kw_only=True):
    """A GPU partition of Fabric Manager's shared NVSwitch mode: GPUs that share NVLink only with each other
    once it is activated."""

    id: Annotated[int, doc("Fabric Manager's partition id.")]
    active: Annotated[bool, doc("Whether Fabric Manager has the partition activated now.")] = False
    gpus: Annotated[list[FabricPartitionGpu], doc("The partition's GPUs.")] = msgspec.field(default_factory=list)

    @property
    def devices(self) -> frozenset[str]:
        """The partition's GPUs as device names (gpu-<minor>) of this node."""
        return frozenset(g.device for g in self.gpus if g.device)


class FabricManagerState(msgspec.Struct, kw_only=True):
    """Fabric Manager partitions on a node whose discovery runs with --fabric-manager-partitions."""

    partitions: Annotated[list[FabricPartition], doc("Every partition Fabric Manager supports on the node.")] = (
        msgspec.field(default_factory=list)
    )
    error: Annotated[str, doc("Why Fabric Manager could not be asked at the last scan; '' when it answered.")] = ""


class Gpu(msgspec.Struct, kw_only=True):
    """A physical GPU as NVML reports it."""

    name: Annotated[str, doc("The device name, gpu-<minor>.")]
    index: Annotated[int, doc("NVML device index.")]
    minor: Annotated[int, doc("The device's minor number (/dev/nvidia<minor>).")]
    uuid: Annotated[str, doc("The GPU UUID (GPU-...).")]
    product_name: Annotated[str, doc("NVML product name, e.g. NVIDIA H100 80GB HBM3.")]
    brand: Annotated[str, doc("NVML brand, e.g. Nvidia or Tesla.")]
    architecture: Annotated[str, doc("GPU architecture, e.g. Hopper.")]
    cuda_compute_capability: Annotated[str, doc("CUDA compute capability as semver, e.g. 9.0.0.")]
    memory_bytes: Annotated[int, doc("Total framebuffer memory.", unit="bytes")]
    pci_bus_id: Annotated[str, doc("PCI bus id, e.g. 0000:3b:00.0.")]
    pcie_root: Annotated[str, doc("The PCIe root complex, e.g. pci0000:3a; '' when unknown.")] = ""
    numa_node: Annotated[int, doc("NUMA node of the GPU; -1 when unknown.")] = -1
    addressing_mode: Annotated[str, doc("HMM, ATS, or '' when unsupported.")] = ""
    mig_capable: Annotated[bool, doc("Whether the GPU supports MIG.")] = False
    mig_enabled: Annotated[bool, doc("Whether MIG mode is on.")] = False
    memory_slice_count: Annotated[int, doc("MIG memory slices of the GPU; 0 without MIG.")] = 0
    mig_profiles: Annotated[list[MigProfile], doc("The GPU's MIG profile table.")] = msgspec.field(default_factory=list)
    mig_devices: Annotated[list[MigDevice], doc("MIG devices that exist now.")] = msgspec.field(default_factory=list)
    fabric: Annotated[FabricInfo | None, doc("NVLink fabric membership; null without Multi-Node NVLink.")] = None
    sharing: Annotated[Sharing, doc("The sharing state applied to the GPU.")] = msgspec.field(default_factory=Sharing)
    device_path: Annotated[str, doc("The device node, /dev/nvidia<minor>.")] = ""
    module_id: Annotated[int, doc("The GPU's module id on an HGX baseboard (NVML module id); 0 when unknown.")] = 0


class NodeInventory(Message, kw_only=True):
    """Everything discovery knows about a node's GPUs. KV value under the node name."""

    node: Annotated[str, doc("The node; equals the subject's (or KV key's) node token.")]
    driver_version: Annotated[str, doc("NVIDIA driver version, semver-normalised, e.g. 550.163.1.")]
    cuda_driver_version: Annotated[str, doc("CUDA driver API version, e.g. 12.4.0.")]
    gpus: Annotated[list[Gpu], doc("The node's physical GPUs.")] = msgspec.field(default_factory=list)
    control_device_paths: Annotated[list[str], doc("Control device nodes, e.g. /dev/nvidiactl.")] = msgspec.field(
        default_factory=list
    )
    dev_root: Annotated[str, doc("Where the node's /dev lives (a fake tree under simulation).")] = "/"
    simulated: Annotated[bool, doc("True when the inventory comes from the simulated NVML.")] = False
    features: Annotated[
        dict[str, bool],
        doc(
            "The feature gates in force on the node's discovery (`gpu-dra features`), by name: the publisher offers "
            "a gated feature's devices only on nodes whose gate is on. Empty from older nodes: the defaults."
        ),
    ] = msgspec.field(default_factory=dict)
    fabric_manager: Annotated[
        FabricManagerState | None,
        doc("Fabric Manager's NVLink partitions (shared NVSwitch mode); null when the node does not use them."),
    ] = None
    content_hash: Annotated[str, doc("Hash of the content above; an unchanged hash means nothing changed.")] = ""
    observed_at: Annotated[float, OBSERVED_AT] = 0.0


class InventoryWithdrawn(Message, kw_only=True):
    """Discovery on a node stopped for good (node drained or removed): its slices go."""

    node: Annotated[str, doc("The node; equals the subject's node token.")]
    reason: Annotated[str, doc("Why the inventory was withdrawn, for people.")] = ""
    observed_at: Annotated[float, OBSERVED_AT] = 0.0
