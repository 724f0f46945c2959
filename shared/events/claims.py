"""Claim lifecycle events from the preparer: what was prepared where, for whom, for how long."""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.events.base import Message

ClaimEventKind = Literal["prepare-started", "prepared", "prepare-failed", "unprepared", "rolled-back"]

FailureReason = Literal["", "not-found", "not-allocated", "other-node", "invalid-config", "device-busy",
                        "device-error", "timeout", "internal"]
"""Why a prepare failed, as a class a consumer can count on (`prepare-failed` events; "" otherwise):
not-found (claim gone or replaced), not-allocated, other-node (allocated to another node or pool),
invalid-config (opaque config or allocation this driver refuses), device-busy (held by another claim,
or not ready yet), device-error (discovery or the device refused), timeout (a device operation ran past
its deadline), internal (checkpoint, CDI or anything else on this node)."""


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
    reason: FailureReason = ""  # prepare-failed: the class of the failure (see FailureReason)
    event_id: str = ""  # `<node>/<claim uid>/<preparation>/<event>`: see claim_event_id
    observed_at: float = 0.0


def claim_event_id(node: str, claim_uid: str, preparation: int, event: str) -> str:
    """The id the preparer on `node` gives a claim event: one per step of one preparation. `preparation`
    is the node's preparation sequence (in the preparer's checkpoint; it survives unprepare and restarts),
    so re-preparing a claim, a retry and a rollback each get ids of their own, while a resend of the same
    event keeps its id. Scoped by the node, which the event's subject authenticates, so no other node can
    mint an id that collides with it. (Ids from before 2026-12 are `<node>/<uid>/<event>/<generation>` or,
    older, lack the node.)"""
    return f"{node}/{claim_uid}/{preparation}/{event}"


def event_id_node(event_id: str) -> str | None:
    """The node a claim event id names; "" for an id without one (empty, or the older
    `<claim uid>/<event>/<generation>`); None for an id of neither shape."""
    parts = event_id.split("/")
    if event_id == "" or len(parts) == 3:
        return ""
    if len(parts) == 4 and all(parts):
        return parts[0]
    return None
