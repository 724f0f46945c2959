"""Messages the ComputeDomain service adds to the catalog in `shared/events` (proposed there).

Owns the agent's request/reply pair that the channel preparer uses on a node
(`dra.v1.cd-agent.<node>.join|leave`), `dra.v1.cd.<domain-uid>.left.<node>` and the controller's
`dra.v1.cd.<domain-uid>.deleted` event, until they move into `shared/events/computedomain.py` and `shared/events/catalog.py`.
"""

from __future__ import annotations

from typing import Literal

from shared.events.base import Message
from shared.events.catalog import Entry

JoinErrorCode = Literal["", "conflict", "invalid", "unavailable", "internal"]


class JoinRequest(Message, kw_only=True):
    """Preparer -> agent: a channel claim for a domain is being prepared on this node."""

    domain_uid: str
    claim_uid: str
    claim_namespace: str
    claim_name: str = ""


class JoinReply(Message, kw_only=True):
    """Agent -> preparer: accepted (the daemon is starting or running) or why not."""

    ok: bool
    error_code: JoinErrorCode = ""
    error: str = ""
    domain_uid: str = ""
    domain_name: str = ""
    domain_namespace: str = ""
    clique_id: str = ""
    index: int = -1


class LeaveRequest(Message, kw_only=True):
    """Preparer -> agent: a channel claim was unprepared on this node."""

    domain_uid: str
    claim_uid: str


class LeaveReply(Message, kw_only=True):
    ok: bool
    error: str = ""
    left_domain: bool = False  # the last claim went: the daemon was stopped and the member removed


class MemberLeft(Message, kw_only=True):
    """A node left a domain (its last claim went, its daemon was stopped, or the domain was deleted)."""

    domain_uid: str
    node: str
    reason: str = ""
    observed_at: float = 0.0


class DomainDeleted(Message, kw_only=True):
    """The controller is deleting a domain: agents stop its daemon and leave."""

    domain_uid: str
    domain_name: str
    domain_namespace: str
    observed_at: float = 0.0


CD_AGENT_JOIN = Entry(
    "cd-agent-join", "dra.v1.cd-agent.{node}.join", JoinRequest, "request",
    "A channel claim for a ComputeDomain is prepared on a node: run its IMEX daemon, join.", JoinReply,
)
CD_AGENT_LEAVE = Entry(
    "cd-agent-leave", "dra.v1.cd-agent.{node}.leave", LeaveRequest, "request",
    "A channel claim was unprepared on a node; the last one leaves the domain.", LeaveReply,
)
CD_MEMBER_LEFT = Entry(
    "cd-member-left", "dra.v1.cd.{domain_uid}.left.{node}", MemberLeft, "event",
    "A node left a ComputeDomain (its KV entry under <domain-uid>.<node> was deleted).",
)
CD_DELETED = Entry(
    "cd-deleted", "dra.v1.cd.{domain_uid}.deleted", DomainDeleted, "event",
    "A ComputeDomain is being deleted; its daemons stop and its members leave.",
)
