"""Device operations the preparer asks of discovery (request/reply on `dra.v1.device.<node>.<op>`).

Every request is idempotent: repeating it after a lost reply returns the same result.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.events.base import Message
from shared.events.inventory import MigDevice, MigPlacement


class DeviceOpError(msgspec.Struct, kw_only=True):
    """Why an operation was refused. `code` is stable for programs; `message` is for people."""

    code: str  # e.g. "not-found", "placement-overlap", "invalid-argument", "nvml-error"
    message: str


class SetSharingRequest(Message, kw_only=True):
    """Set compute mode and time-slice interval on GPUs (by UUID)."""

    gpu_uuids: list[str]
    compute_mode: Literal["Default", "ExclusiveProcess", "Prohibited"] = "Default"
    timeslice: Literal["Default", "Short", "Medium", "Long"] = "Default"


class SetSharingReply(Message, kw_only=True):
    ok: bool
    error: DeviceOpError | None = None


class MigCreateRequest(Message, kw_only=True):
    """Create a MIG device with a profile at a placement on a GPU."""

    gpu_uuid: str
    profile: str  # e.g. "1g.10gb"
    placement: MigPlacement


class MigCreateReply(Message, kw_only=True):
    ok: bool
    device: MigDevice | None = None
    created: bool = False  # False when it already existed (idempotent repeat)
    error: DeviceOpError | None = None


class MigDestroyRequest(Message, kw_only=True):
    gpu_uuid: str
    mig_uuid: str


class MigDestroyReply(Message, kw_only=True):
    ok: bool
    destroyed: bool = False  # False when it was already gone
    error: DeviceOpError | None = None


class MpsStartRequest(Message, kw_only=True):
    """Start (or confirm) an MPS control daemon for a set of GPUs."""

    daemon_id: str  # claim-scoped id chosen by the preparer
    gpu_uuids: list[str]
    active_thread_percentage: int | None = None
    pinned_device_memory_limits: dict[str, int] = msgspec.field(default_factory=dict)  # uuid -> bytes


class MpsStartReply(Message, kw_only=True):
    ok: bool
    pipe_dir: str = ""
    shm_dir: str = ""
    log_dir: str = ""
    error: DeviceOpError | None = None


class MpsStopRequest(Message, kw_only=True):
    daemon_id: str


class MpsStopReply(Message, kw_only=True):
    ok: bool
    stopped: bool = False
    error: DeviceOpError | None = None


class InjectXidRequest(Message, kw_only=True):
    """Simulation and demos: raise an XID (or GPU-lost when xid == 0 and gpu_lost) on a device."""

    gpu_uuid: str
    xid: int = 0
    gpu_lost: bool = False
    recover: bool = False  # mark the device healthy again instead


class InjectXidReply(Message, kw_only=True):
    ok: bool
    error: DeviceOpError | None = None
