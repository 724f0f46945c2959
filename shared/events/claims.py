"""Claim lifecycle events from the preparer: what was prepared where, for whom, for how long."""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.events.base import Message

ClaimEventKind = Literal["prepare-started", "prepared", "prepare-failed", "unprepared", "rolled-back"]


class PreparedDeviceRef(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One device a claim got on a node."""

    request: str
    pool: str
    device: str
    uuid: str = ""
    sharing: str = ""  # "" | TimeSlicing | MPS
    cdi_device_ids: list[str] = msgspec.field(default_factory=list)


class ClaimLifecycle(Message, kw_only=True):
    """A step in a claim's life on a node. Subject `dra.v1.claim.<namespace>.<node>.<event>`."""

    event: ClaimEventKind
    node: str
    driver: str
    claim_uid: str
    claim_namespace: str
    claim_name: str
    devices: list[PreparedDeviceRef] = msgspec.field(default_factory=list)
    error: str = ""
    event_id: str = ""  # `<claim uid>/<event>/<prepare generation>`: replay-safe de-duplication key
    observed_at: float = 0.0
