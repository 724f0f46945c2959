"""Device health as discovery observes it (XID errors, GPU lost) and as the publisher taints it."""

from __future__ import annotations

from typing import Literal

from shared.events.base import Message

HealthState = Literal["Healthy", "Unhealthy", "Unknown"]


class DeviceHealth(Message, kw_only=True):
    """The health of one device. Published on change; last value kept in KV `<node>.<device>`."""

    node: str
    device: str  # gpu-<minor> or a MIG device name
    uuid: str = ""
    state: HealthState
    reason: str = ""  # "xid" | "gpu-lost" | "recovered"
    xid: int = 0
    message: str = ""
    event_id: str = ""  # stable id of the NVML event that caused it, for de-duplication
    observed_at: float = 0.0
