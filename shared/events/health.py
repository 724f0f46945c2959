"""Device health as discovery observes it (XID errors, GPU lost) and as the publisher taints it."""

from __future__ import annotations

from typing import Annotated, Literal

from shared.events.base import OBSERVED_AT, Message, doc

HealthState = Literal["Healthy", "Unhealthy", "Unknown"]


class DeviceHealth(Message, kw_only=True):
    """The health of one device. Published on change; last value kept in KV `<node>.<device>`."""

    node: Annotated[str, doc("The node; equals the subject's node token.")]
    device: Annotated[str, doc("The device name, gpu-<minor> or a MIG device name; equals the subject's device token.")]
    uuid: Annotated[str, doc("The GPU or MIG device UUID.")] = ""
    state: Annotated[HealthState, doc("Healthy, Unhealthy or Unknown.")]
    reason: Annotated[str, doc("What changed: xid, gpu-lost or recovered.")] = ""
    xid: Annotated[int, doc("The XID error code for reason xid; 0 otherwise.")] = 0
    message: Annotated[str, doc("What happened, for people.")] = ""
    event_id: Annotated[str, doc("Stable id of the NVML event that caused it, for de-duplication.")] = ""
    observed_at: Annotated[float, OBSERVED_AT] = 0.0
