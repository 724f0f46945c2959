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
    event_id: str = ""  # `<node>/<claim uid>/<event>/<prepare generation>`: see claim_event_id
    observed_at: float = 0.0


def claim_event_id(node: str, claim_uid: str, event: str, generation: int) -> str:
    """The id the preparer on `node` gives a claim event: replay-safe (the same step of the same claim
    always gets the same id) and scoped by the node, which its subject authenticates, so no other
    node can mint an id that collides with it. (Ids from before 2026-12 lack the node.)"""
    return f"{node}/{claim_uid}/{event}/{generation}"


def event_id_node(event_id: str) -> str | None:
    """The node a claim event id names; "" for an id without one (empty, or the older
    `<claim uid>/<event>/<generation>`); None for an id of neither shape."""
    parts = event_id.split("/")
    if event_id == "" or len(parts) == 3:
        return ""
    if len(parts) == 4 and all(parts):
        return parts[0]
    return None
