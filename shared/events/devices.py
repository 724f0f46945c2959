"""Device operations the preparer asks of discovery (request/reply on `dra.v1.device.<node>.<op>`).

Every request is idempotent: repeating it after a lost reply returns the same result.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.events.base import Message, doc
from shared.events.inventory import MigDevice, MigPlacement


class DeviceOpError(msgspec.Struct, kw_only=True):
    """Why an operation was refused. `code` is stable for programs; `message` is for people."""

    code: Annotated[
        str, doc("Stable code for programs: not-found, placement-overlap, invalid-argument, nvml-error, ...")
    ]
    message: Annotated[str, doc("What went wrong, for people.")]


class SetSharingRequest(Message, kw_only=True):
    """Set compute mode and time-slice interval on GPUs (by UUID)."""

    gpu_uuids: Annotated[list[str], doc("The GPUs, by UUID.")]
    compute_mode: Annotated[Literal["Default", "ExclusiveProcess", "Prohibited"], doc("NVML compute mode to set.")] = (
        "Default"
    )
    timeslice: Annotated[Literal["Default", "Short", "Medium", "Long"], doc("Time-slice interval to set.")] = "Default"


class SetSharingReply(Message, kw_only=True):
    ok: Annotated[bool, doc("Whether the operation was carried out (or already in effect).")]
    error: Annotated[DeviceOpError | None, doc("Why not; null on success.")] = None


class MigCreateRequest(Message, kw_only=True):
    """Create a MIG device with a profile at a placement on a GPU."""

    gpu_uuid: Annotated[str, doc("The GPU, by UUID.")]
    profile: Annotated[str, doc("The MIG profile, e.g. 1g.10gb.")]
    placement: Annotated[MigPlacement, doc("Where to place the GPU instance.")]


class MigCreateReply(Message, kw_only=True):
    ok: Annotated[bool, doc("Whether the operation was carried out (or already in effect).")]
    device: Annotated[MigDevice | None, doc("The MIG device; null on failure.")] = None
    created: Annotated[bool, doc("False when it already existed (an idempotent repeat).")] = False
    error: Annotated[DeviceOpError | None, doc("Why not; null on success.")] = None


class MigDestroyRequest(Message, kw_only=True):
    gpu_uuid: Annotated[str, doc("The GPU, by UUID.")]
    mig_uuid: Annotated[str, doc("The MIG device, by UUID.")]


class MigDestroyReply(Message, kw_only=True):
    ok: Annotated[bool, doc("Whether the operation was carried out (or already in effect).")]
    destroyed: Annotated[bool, doc("False when it was already gone.")] = False
    error: Annotated[DeviceOpError | None, doc("Why not; null on success.")] = None


class MpsStartRequest(Message, kw_only=True):
    """Start (or confirm) an MPS control daemon for a set of GPUs."""

    daemon_id: Annotated[str, doc("Claim-scoped id of the MPS control daemon, chosen by the preparer.")]
    gpu_uuids: Annotated[list[str], doc("The GPUs, by UUID.")]
    active_thread_percentage: Annotated[
        int | None, doc("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for clients; null: unlimited.", unit="percent")
    ] = None
    pinned_device_memory_limits: Annotated[
        dict[str, int], doc("Pinned device memory limit per GPU UUID.", unit="bytes")
    ] = msgspec.field(default_factory=dict)


class MpsStartReply(Message, kw_only=True):
    ok: Annotated[bool, doc("Whether the operation was carried out (or already in effect).")]
    pipe_dir: Annotated[str, doc("CUDA_MPS_PIPE_DIRECTORY of the daemon.")] = ""
    shm_dir: Annotated[str, doc("The daemon's /dev/shm directory.")] = ""
    log_dir: Annotated[str, doc("CUDA_MPS_LOG_DIRECTORY of the daemon.")] = ""
    error: Annotated[DeviceOpError | None, doc("Why not; null on success.")] = None


class MpsStopRequest(Message, kw_only=True):
    daemon_id: Annotated[str, doc("The MPS control daemon's id.")]


class MpsStopReply(Message, kw_only=True):
    ok: Annotated[bool, doc("Whether the operation was carried out (or already in effect).")]
    stopped: Annotated[bool, doc("False when it was not running.")] = False
    error: Annotated[DeviceOpError | None, doc("Why not; null on success.")] = None


class InjectXidRequest(Message, kw_only=True):
    """Simulation and demos: raise an XID (or GPU-lost when xid == 0 and gpu_lost) on a device."""

    gpu_uuid: Annotated[str, doc("The GPU, by UUID.")]
    xid: Annotated[int, doc("The XID code to raise.")] = 0
    gpu_lost: Annotated[bool, doc("Raise GPU-lost instead of an XID.")] = False
    recover: Annotated[bool, doc("Mark the device healthy again instead.")] = False


class InjectXidReply(Message, kw_only=True):
    ok: Annotated[bool, doc("Whether the operation was carried out (or already in effect).")]
    error: Annotated[DeviceOpError | None, doc("Why not; null on success.")] = None


class PartitionActivateRequest(Message, kw_only=True):
    """Activate a Fabric Manager NVLink partition (shared NVSwitch mode) for a claim's GPUs."""

    partition_id: Annotated[int, doc("Fabric Manager's partition id.")]
    devices: Annotated[list[str], doc("The claim's GPUs (gpu-<minor>): the partition must hold exactly these.")]


class PartitionActivateReply(Message, kw_only=True):
    ok: Annotated[bool, doc("Whether the partition is active now.")]
    activated: Annotated[bool, doc("False when it was active already (an idempotent repeat).")] = False
    error: Annotated[DeviceOpError | None, doc("Why not; null on success.")] = None


class PartitionDeactivateRequest(Message, kw_only=True):
    """Deactivate a Fabric Manager NVLink partition after its last claim."""

    partition_id: Annotated[int, doc("Fabric Manager's partition id.")]


class PartitionDeactivateReply(Message, kw_only=True):
    ok: Annotated[bool, doc("Whether the partition is inactive now.")]
    deactivated: Annotated[bool, doc("False when it was inactive already.")] = False
    error: Annotated[DeviceOpError | None, doc("Why not; null on success.")] = None
