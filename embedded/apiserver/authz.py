"""The authorizer chain kube-apiserver runs with `--authorization-mode=Node,RBAC`.

Owns the order and how decisions combine, as upstream's union authorizer does: the Node authorizer
first (it allows, or has no opinion), then RBAC; the first allow wins, and a refusal carries every
reason given, joined by newlines (the 403's message ends with them: `...: no relationship found
between node 'n' and this object`). Rules for SelfSubjectRulesReview are RBAC's; for a node they are
incomplete, as upstream's Node authorizer says it cannot list them.
"""

from __future__ import annotations

from typing import Any, Protocol

from embedded.apiserver.authn import UserInfo, node_identity
from embedded.apiserver.nodeauthz import Decision, NodeAuthorizer
from embedded.apiserver.rbac import Attributes, RbacAuthorizer

NODE_RULES_ERROR = "node authorizer does not support user rule resolution"


class Authorizer(Protocol):
    def authorize(self, user: UserInfo, attrs: Attributes) -> tuple[bool, str]: ...


class Chain:
    """Node, then RBAC: `authorize` answers (allowed, reason) as RbacAuthorizer does alone."""

    def __init__(self, node: NodeAuthorizer, rbac: RbacAuthorizer) -> None:
        self.node = node
        self.rbac = rbac

    def authorize(self, user: UserInfo, attrs: Attributes) -> tuple[bool, str]:
        decision, node_reason = self.node.authorize(user, attrs)
        if decision is Decision.ALLOW:
            return True, ""
        allowed, rbac_reason = self.rbac.authorize(user, attrs)
        if allowed:
            return True, ""
        return False, "\n".join(r for r in (node_reason, rbac_reason) if r)

    def rules_for(self, user: UserInfo, namespace: str) -> tuple[list[dict[str, Any]], str]:
        """RBAC's rules for `user` in `namespace`, and why they are incomplete ("" when they are not)."""
        return self.rbac.rules_for(user, namespace), NODE_RULES_ERROR if node_identity(user)[1] else ""
