"""ComputeDomain messages: membership and readiness on `dra.v1.cd.<domain-uid>.<event>`, and the node
agent's request/reply pair on `dra.v1.cd-agent.<node>.join|leave` that the channel preparer uses."""

from __future__ import annotations

from typing import Literal

from shared.events.base import Message

MemberStatus = Literal["NotReady", "Ready"]
JoinErrorCode = Literal["", "conflict", "invalid", "unavailable", "internal"]


class DomainMember(Message, kw_only=True):
    """A node's membership in a ComputeDomain. KV value under `<domain-uid>.<node>`."""

    domain_uid: str
    domain_name: str
    domain_namespace: str
    node: str
    ip_address: str
    clique_id: str
    index: int  # DNS index within the clique, lowest free, < 18
    status: MemberStatus = "NotReady"
    observed_at: float = 0.0


class DomainStatusChanged(Message, kw_only=True):
    """The controller's view of a domain changed (Ready/NotReady, node count)."""

    domain_uid: str
    domain_name: str
    domain_namespace: str
    status: MemberStatus
    nodes: int
    observed_at: float = 0.0


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


class JoinRequest(Message, kw_only=True):
    """Preparer -> agent: a channel claim for a domain is being prepared on this node."""

    domain_uid: str
    claim_uid: str
    claim_namespace: str
    claim_name: str = ""


class JoinReply(Message, kw_only=True):
    """Agent -> preparer: accepted (the daemon is starting or running) or why not.

    `error_code`: `conflict` (the node serves another domain, or the clique is full: permanent),
    `unavailable` (the domain or the node's inventory is not known yet: retry), `invalid`
    (e.g. the claim is not in the domain's namespace: permanent), `internal`."""

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
    """Agent -> preparer: the claim is released (also when it was never known: idempotent)."""

    ok: bool
    error: str = ""
    left_domain: bool = False  # the last claim went: the daemon was stopped and the member removed
