"""ComputeDomain membership and readiness events, on `dra.v1.cd.<domain-uid>.<event>`."""

from __future__ import annotations

from typing import Literal

from shared.events.base import Message

MemberStatus = Literal["NotReady", "Ready"]


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
