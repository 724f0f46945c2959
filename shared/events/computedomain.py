"""ComputeDomain messages: membership and readiness on `dra.v1.cd.<domain-uid>.<event>`, and the node
agent's request/reply pair on `dra.v1.cd-agent.<node>.join|leave` that the channel preparer uses."""

from __future__ import annotations

from typing import Annotated, Literal

from shared.events.base import OBSERVED_AT, Message, doc

MemberStatus = Literal["NotReady", "Ready"]
JoinErrorCode = Literal["", "conflict", "invalid", "unavailable", "internal"]


class DomainMember(Message, kw_only=True):
    """A node's membership in a ComputeDomain. KV value under `<domain-uid>.<node>`."""

    domain_uid: Annotated[str, doc("The ComputeDomain's metadata.uid; equals the subject's domain token.")]
    domain_name: Annotated[str, doc("The ComputeDomain's name.")]
    domain_namespace: Annotated[str, doc("The ComputeDomain's namespace.")]
    node: Annotated[str, doc("The node; equals the subject's node token.")]
    ip_address: Annotated[str, doc("The node's IP address the IMEX daemons reach it on.")]
    clique_id: Annotated[str, doc("The NVLink clique, <cluster uuid>.<clique id>.")]
    index: Annotated[int, doc("The node's DNS index within the clique (lowest free, < 18).")]
    status: Annotated[MemberStatus, doc("NotReady or Ready (its IMEX daemon serves the domain).")] = "NotReady"
    observed_at: Annotated[float, OBSERVED_AT] = 0.0


class DomainStatusChanged(Message, kw_only=True):
    """The controller's view of a domain changed (Ready/NotReady, node count)."""

    domain_uid: Annotated[str, doc("The ComputeDomain's metadata.uid; equals the subject's domain token.")]
    domain_name: Annotated[str, doc("The ComputeDomain's name.")]
    domain_namespace: Annotated[str, doc("The ComputeDomain's namespace.")]
    status: Annotated[MemberStatus, doc("The domain's readiness: NotReady or Ready.")]
    nodes: Annotated[int, doc("Nodes in the domain now.")]
    observed_at: Annotated[float, OBSERVED_AT] = 0.0


class MemberLeft(Message, kw_only=True):
    """A node left a domain (its last claim went, its daemon was stopped, or the domain was deleted)."""

    domain_uid: Annotated[str, doc("The ComputeDomain's metadata.uid; equals the subject's domain token.")]
    node: Annotated[str, doc("The node; equals the subject's node token.")]
    reason: Annotated[str, doc("Why the node left, for people.")] = ""
    observed_at: Annotated[float, OBSERVED_AT] = 0.0


class DomainDeleted(Message, kw_only=True):
    """The controller is deleting a domain: agents stop its daemon and leave."""

    domain_uid: Annotated[str, doc("The ComputeDomain's metadata.uid; equals the subject's domain token.")]
    domain_name: Annotated[str, doc("The ComputeDomain's name.")]
    domain_namespace: Annotated[str, doc("The ComputeDomain's namespace.")]
    observed_at: Annotated[float, OBSERVED_AT] = 0.0


class JoinRequest(Message, kw_only=True):
    """Preparer -> agent: a channel claim for a domain is being prepared on this node."""

    domain_uid: Annotated[str, doc("The ComputeDomain's metadata.uid; equals the subject's domain token.")]
    claim_uid: Annotated[str, doc("The channel claim's metadata.uid.")]
    claim_namespace: Annotated[str, doc("The channel claim's namespace.")]
    claim_name: Annotated[str, doc("The channel claim's name.")] = ""


class JoinReply(Message, kw_only=True):
    """Agent -> preparer: accepted (the daemon is starting or running) or why not.

    `error_code`: `conflict` (the node serves another domain, or the clique is full: permanent),
    `unavailable` (the domain or the node's inventory is not known yet: retry), `invalid`
    (e.g. the claim is not in the domain's namespace: permanent), `internal`."""

    ok: Annotated[bool, doc("Whether the request was carried out.")]
    error_code: Annotated[
        JoinErrorCode, doc("Why not, for programs: conflict, invalid, unavailable or internal; '' on success.")
    ] = ""
    error: Annotated[str, doc("Why not, for people; '' on success.")] = ""
    domain_uid: Annotated[str, doc("The ComputeDomain's metadata.uid; equals the subject's domain token.")] = ""
    domain_name: Annotated[str, doc("The domain's name.")] = ""
    domain_namespace: Annotated[str, doc("The domain's namespace.")] = ""
    clique_id: Annotated[str, doc("The node's NVLink clique.")] = ""
    index: Annotated[int, doc("The node's DNS index in the clique; -1 when not joined.")] = -1


class LeaveRequest(Message, kw_only=True):
    """Preparer -> agent: a channel claim was unprepared on this node."""

    domain_uid: Annotated[str, doc("The ComputeDomain's metadata.uid; equals the subject's domain token.")]
    claim_uid: Annotated[str, doc("The channel claim's metadata.uid.")]


class LeaveReply(Message, kw_only=True):
    """Agent -> preparer: the claim is released (also when it was never known: idempotent)."""

    ok: Annotated[bool, doc("Whether the request was carried out.")]
    error: Annotated[str, doc("Why not, for people; '' on success.")] = ""
    left_domain: Annotated[bool, doc("The last claim went: the daemon was stopped and the member removed.")] = False
