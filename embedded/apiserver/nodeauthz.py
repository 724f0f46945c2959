"""The Node authorizer: what a kubelet (`system:node:<node>` in group `system:nodes`) may do to the
objects that belong to nodes, as upstream's `--authorization-mode=Node` decides it.

Owns the subdivided resources and their rules: secrets and configmaps read only when a pod bound to
the node names them; PVCs, PVs and ResourceClaims `get` only likewise (PVC status updates too);
`serviceaccounts/token` created only for a ServiceAccount of such a pod; Leases only in
`kube-node-lease` under the node's own name; ResourceSlices created freely (NodeRestriction checks
their `spec.nodeName`), read, updated and deleted only with `spec.nodeName` the node, listed, watched
and deleted as a collection only with the `spec.nodeName=<node>` field selector; Nodes created,
updated and patched freely (NodeRestriction again), read only itself; Pods read only when bound to it,
listed and watched only with `spec.nodeName=<node>`, created, deleted, evicted and their status
written freely (NodeRestriction). Like upstream it never denies: it allows or has no opinion, with
upstream's reason, and the next authorizer (RBAC) decides the rest; nodes hold no RBAC grant on
these resources (embedded/cluster/identities.py), so its refusal stands.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from embedded.apiserver.authn import UserInfo, node_identity
from embedded.apiserver.nodegraph import (
    CONFIGMAP,
    POD,
    PV,
    PVC,
    RESOURCECLAIM,
    RESOURCESLICE,
    SECRET,
    SERVICEACCOUNT,
    NodeGraph,
)
from embedded.apiserver.rbac import Attributes

NODE_LEASE_NAMESPACE = "kube-node-lease"


class Decision(enum.Enum):
    ALLOW = "Allow"
    NO_OPINION = "NoOpinion"


Verdict = tuple[Decision, str]
_ALLOW: Verdict = (Decision.ALLOW, "")
_NONE: Verdict = (Decision.NO_OPINION, "")


def _no(reason: str) -> Verdict:
    return Decision.NO_OPINION, reason


def _selects_node(attrs: Attributes, field: str, node: str) -> bool:
    return any(key == field and op == "=" and value == node for key, op, value in attrs.field_selector)


class NodeAuthorizer:
    """Decides the requests of node users on node-scoped objects; no opinion on anything else."""

    def __init__(self, graph: NodeGraph) -> None:
        self.graph = graph
        self._by_resource: dict[tuple[str, str], Callable[[str, Attributes], Verdict]] = {
            ("", "secrets"): lambda node, a: self._read_namespaced(node, SECRET, a),
            ("", "configmaps"): lambda node, a: self._read_namespaced(node, CONFIGMAP, a),
            ("", "persistentvolumeclaims"): self._pvc,
            ("", "persistentvolumes"): lambda node, a: self._get(node, PV, a),
            ("resource.k8s.io", "resourceclaims"): lambda node, a: self._get(node, RESOURCECLAIM, a),
            ("", "serviceaccounts"): self._token,
            ("coordination.k8s.io", "leases"): self._lease,
            ("resource.k8s.io", "resourceslices"): self._slice,
            ("", "nodes"): self._node,
            ("", "pods"): self._pod,
        }

    def authorize(self, user: UserInfo, attrs: Attributes) -> Verdict:
        node, is_node = node_identity(user)
        if not is_node:
            return _NONE
        if not node:
            return _no(f'unknown node for user "{user.username}"')
        if attrs.resource_request:
            rule = self._by_resource.get((attrs.api_group, attrs.resource))
            if rule is not None:
                return rule(node, attrs)
        return _NONE

    # ---- the related-object checks

    def _path(self, node: str, kind: str, attrs: Attributes) -> Verdict:
        if not attrs.name:
            return _no("No Object name found")
        if self.graph.related(node, kind, attrs.namespace, attrs.name):
            return _ALLOW
        return _no(f"no relationship found between node '{node}' and this object")

    def _read_namespaced(self, node: str, kind: str, attrs: Attributes) -> Verdict:
        if attrs.verb not in ("get", "list", "watch"):
            return _no("can only read resources of this type")
        if attrs.subresource:
            return _no("cannot read subresource")
        if not attrs.namespace:
            return _no("can only read namespaced object of this type")
        return self._path(node, kind, attrs)

    def _get(self, node: str, kind: str, attrs: Attributes) -> Verdict:
        if attrs.verb != "get":
            return _no("can only get individual resources of this type")
        if attrs.subresource:
            return _no("cannot get subresource")
        return self._path(node, kind, attrs)

    def _pvc(self, node: str, attrs: Attributes) -> Verdict:
        if attrs.subresource == "status":
            if attrs.verb not in ("update", "patch"):
                return _no("can only get/update/patch this type")
            return self._path(node, PVC, attrs)
        return self._get(node, PVC, attrs)

    def _token(self, node: str, attrs: Attributes) -> Verdict:
        if attrs.verb != "create" or not attrs.name:
            return _no("can only create tokens for individual service accounts")
        if attrs.subresource != "token":
            return _no("can only create token subresource of serviceaccount")
        return self._path(node, SERVICEACCOUNT, attrs)

    # ---- the node's own objects

    def _lease(self, node: str, attrs: Attributes) -> Verdict:
        if attrs.verb not in ("get", "create", "update", "patch", "delete"):
            return _no("can only get, create, update, patch, or delete a node lease")
        if attrs.namespace != NODE_LEASE_NAMESPACE:
            return _no(f'can only access leases in the "{NODE_LEASE_NAMESPACE}" system namespace')
        # create names no lease here: NodeRestriction checks the created one's name
        if attrs.verb != "create" and attrs.name != node:
            return _no("can only access node lease with the same name as the requesting node")
        return _ALLOW

    def _slice(self, node: str, attrs: Attributes) -> Verdict:
        if attrs.subresource:
            return _no("cannot authorize ResourceSlice subresources")
        if attrs.verb == "create":
            return _ALLOW  # NodeRestriction checks the new slice's spec.nodeName
        if attrs.verb in ("get", "update", "patch", "delete"):
            return self._path(node, RESOURCESLICE, attrs)
        if attrs.verb in ("watch", "list", "deletecollection"):
            if _selects_node(attrs, "spec.nodeName", node):
                return _ALLOW  # a collection's deletes are each checked by NodeRestriction
            return _no("can only list/watch/deletecollection resourceslices with nodeName field selector")
        return _no(
            "only the following verbs are allowed for a ResourceSlice: get, watch, list, create, update, "
            "patch, delete, deletecollection"
        )

    def _node(self, node: str, attrs: Attributes) -> Verdict:
        if not attrs.subresource:
            if attrs.verb in ("create", "update", "patch"):
                return _ALLOW  # NodeRestriction limits the node to its own Node object
            if attrs.verb in ("get", "list", "watch"):
                if attrs.name == node:
                    return _ALLOW
                if not attrs.name:
                    return _no(f"node '{node}' cannot read all nodes, only its own Node object")
                return _no(f"node '{node}' cannot read '{attrs.name}', only its own Node object")
        elif attrs.subresource == "status" and attrs.verb in ("update", "patch"):
            return _ALLOW  # NodeRestriction: its own status only
        return _NONE

    def _pod(self, node: str, attrs: Attributes) -> Verdict:
        if not attrs.subresource:
            if attrs.verb == "get":
                return self._get(node, POD, attrs)
            if attrs.verb in ("list", "watch"):
                if _selects_node(attrs, "spec.nodeName", node):
                    return _ALLOW
                if attrs.name:
                    return self._path(node, POD, attrs)
                return _no("can only list/watch pods with spec.nodeName field selector")
            if attrs.verb in ("create", "delete"):
                return _ALLOW  # mirror pods; NodeRestriction keeps them to pods bound to the node
        elif attrs.subresource == "status" and attrs.verb in ("update", "patch"):
            return _ALLOW  # NodeRestriction: pods bound to the node only
        elif attrs.subresource == "eviction" and attrs.verb == "create":
            return _ALLOW
        return _NONE
