"""NodeRestriction admission: what a kubelet (`system:node:<node>` in `system:nodes`) may write, as
upstream's `--enable-admission-plugins=NodeRestriction` limits it once the Node authorizer let the
request through.

Owns the checks on the objects written: pods created only as mirror pods (annotation
`kubernetes.io/config.mirror`) bound to the node, owned by its Node (controller, no
blockOwnerDeletion, the Node's uid) and naming no ServiceAccount, secret, configmap, PVC,
ClusterTrustBundle or ResourceClaim; pods deleted and their status written only when bound to the
node (status writes keep labels and `status.resourceClaimStatuses`); only its own Node created or
changed (no configSource, no taint change, no labels outside the kubelet's set); a ServiceAccount
token only bound to a pod (by name and uid) on the node; Leases only `kube-node-lease/<node>`;
ResourceSlices created and deleted only with `spec.nodeName` the node. A refusal is upstream's 403
(`<resource> "<name>" is forbidden: <reason>`, the name `Unknown` where the request's object has none).
"""

from __future__ import annotations

from typing import Any

from embedded.apiserver import errors
from embedded.apiserver.authn import UserInfo, node_identity
from embedded.apiserver.nodeauthz import NODE_LEASE_NAMESPACE
from embedded.apiserver.nodegraph import CONFIGMAP, PVC, SECRET, pod_references
from embedded.apiserver.resources import Resource
from embedded.apiserver.storage import Store

MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
NODE_RESTRICTION_LABELS = "node-restriction.kubernetes.io"
# the labels a kubelet may set on its Node (k8s.io/kubelet/pkg/apis: kubeletLabels, kubeletLabelNamespaces)
KUBELET_LABELS = frozenset(
    {
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
        "topology.kubernetes.io/region",
        "failure-domain.beta.kubernetes.io/zone",
        "failure-domain.beta.kubernetes.io/region",
        "beta.kubernetes.io/instance-type",
        "node.kubernetes.io/instance-type",
        "kubernetes.io/os",
        "kubernetes.io/arch",
        "beta.kubernetes.io/os",
        "beta.kubernetes.io/arch",
    }
)
KUBELET_LABEL_NAMESPACES = ("kubelet.kubernetes.io", "node.kubernetes.io")


class _Refused(Exception):
    pass


def _md(obj: dict[str, Any] | None) -> dict[str, Any]:
    md = (obj or {}).get("metadata")
    return md if isinstance(md, dict) else {}


def _spec(obj: dict[str, Any] | None) -> dict[str, Any]:
    spec = (obj or {}).get("spec")
    return spec if isinstance(spec, dict) else {}


def _label_namespace(key: str) -> str:
    prefix, slash, _ = key.partition("/")
    return prefix if slash else ""


def _in_namespace(namespace: str, suffix: str) -> bool:
    return namespace == suffix or namespace.endswith("." + suffix)


def _forbidden_labels(new: dict[str, str], old: dict[str, str]) -> list[str]:
    """The changed labels a kubelet may not set: node-restriction.kubernetes.io ones, and kubernetes.io or
    k8s.io ones outside the kubelet's own set."""
    changed = {k for k in new.keys() | old.keys() if new.get(k) != old.get(k) or (k in new) != (k in old)}
    out = []
    for key in changed:
        namespace = _label_namespace(key)
        restricted = _in_namespace(namespace, NODE_RESTRICTION_LABELS)
        kubernetes = _in_namespace(namespace, "kubernetes.io") or _in_namespace(namespace, "k8s.io")
        kubelet = key in KUBELET_LABELS or any(_in_namespace(namespace, ns) for ns in KUBELET_LABEL_NAMESPACES)
        if restricted or (kubernetes and not kubelet):
            out.append(key)
    return sorted(out)


class NodeRestriction:
    """Admits (or refuses with a 403) the writes of node users; others pass untouched."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def admit(
        self,
        user: UserInfo,
        operation: str,
        res: Resource,
        subresource: str,
        namespace: str,
        name: str,
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
    ) -> None:
        node, is_node = node_identity(user)
        if not is_node:
            return
        try:
            if not node:
                raise _Refused(f'could not determine node from user "{user.username}"')
            check = {
                ("", "pods"): self._pod,
                ("", "nodes"): self._node,
                ("", "serviceaccounts"): self._service_account,
                ("coordination.k8s.io", "leases"): self._lease,
                ("resource.k8s.io", "resourceslices"): self._slice,
            }.get(res.key)
            if check is not None:
                check(node, operation, subresource, namespace, name, obj, old)
        except _Refused as refused:
            shown = str(_md(obj).get("name") or _md(obj).get("generateName") or "Unknown")
            raise errors.forbidden(res, shown, f'{res.group_resource} "{shown}" is forbidden: {refused}') from None

    # ---- pods

    def _pod(
        self,
        node: str,
        operation: str,
        subresource: str,
        namespace: str,
        name: str,
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
    ) -> None:
        if subresource == "status":
            if operation != "UPDATE":
                raise _Refused(f'unexpected operation "{operation}"')
            if _spec(old).get("nodeName") != node:
                raise _Refused(f'node "{node}" can only update pod status for pods with spec.nodeName set to itself')
            if (_md(obj).get("labels") or {}) != (_md(old).get("labels") or {}):
                raise _Refused(f'node "{node}" cannot update labels through pod status')
            if _claim_statuses(obj) != _claim_statuses(old):
                raise _Refused(f'node "{node}" cannot update resource claim statues')
            return
        if subresource == "eviction":
            return  # evictions are admitted as the delete they make
        if subresource:
            raise _Refused(f"unexpected pod subresource \"{subresource}\", only 'status' and 'eviction' are allowed")
        if operation == "CREATE":
            self._mirror_pod(node, obj or {})
        elif operation == "DELETE":
            if _spec(old).get("nodeName") != node:
                raise _Refused(f'node "{node}" can only delete pods with spec.nodeName set to itself')
        else:
            raise _Refused(f'unexpected operation "{operation}", node "{node}" can only create and delete mirror pods')

    def _mirror_pod(self, node: str, pod: dict[str, Any]) -> None:
        if MIRROR_ANNOTATION not in (_md(pod).get("annotations") or {}):
            raise _Refused(
                f'pod does not have "{MIRROR_ANNOTATION}" annotation, node "{node}" can only create mirror pods'
            )
        spec = _spec(pod)
        if spec.get("nodeName") != node:
            raise _Refused(f'node "{node}" can only create pods with spec.nodeName set to itself')
        owners = _md(pod).get("ownerReferences") or []
        if len(owners) > 1:
            raise _Refused(f'node "{node}" can only create pods with a single owner reference set to itself')
        if not owners:
            raise _Refused(f'node "{node}" can only create pods with an owner reference set to itself')
        owner = owners[0] if isinstance(owners[0], dict) else {}
        if owner.get("apiVersion") != "v1" or owner.get("kind") != "Node" or owner.get("name") != node:
            raise _Refused(f'node "{node}" can only create pods with an owner reference set to itself')
        if owner.get("controller") is not True:
            raise _Refused(f'node "{node}" can only create pods with a controller owner reference set to itself')
        if owner.get("blockOwnerDeletion") is True:
            raise _Refused(f'node "{node}" must not set blockOwnerDeletion on an owner reference')
        stored = self.store.get(("", "nodes"), ("", node))
        if stored is None:
            raise errors.ApiError(404, "NotFound", f'nodes "{node}" not found', {"name": node, "kind": "nodes"})
        if owner.get("uid") != _md(stored).get("uid"):
            raise _Refused(
                f"node {node} UID mismatch: expected {owner.get('uid', '')} got {_md(stored).get('uid', '')}"
            )
        if spec.get("serviceAccountName"):
            raise _Refused(f'node "{node}" can not create pods that reference a service account')
        kinds = {kind for kind, _, _ in pod_references(pod)}
        if SECRET in kinds:
            raise _Refused(f'node "{node}" can not create pods that reference secrets')
        if CONFIGMAP in kinds:
            raise _Refused(f'node "{node}" can not create pods that reference configmaps')
        for volume in spec.get("volumes") or []:
            for source in (((volume or {}).get("projected") or {}).get("sources")) or []:
                if isinstance(source, dict) and source.get("clusterTrustBundle") is not None:
                    raise _Refused(f'node "{node}" can not create pods that reference clustertrustbundles')
        if PVC in kinds:
            raise _Refused(f'node "{node}" can not create pods that reference persistentvolumeclaims')
        if spec.get("resourceClaims"):
            raise _Refused(f'node "{node}" can not create pods that reference resourceclaims')

    # ---- the node's own objects

    def _node(
        self,
        node: str,
        operation: str,
        subresource: str,
        namespace: str,
        name: str,
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
    ) -> None:
        if name != node:
            raise _Refused(f'node "{node}" is not allowed to modify node "{name}"')
        if operation == "CREATE":
            if _spec(obj).get("configSource") is not None:
                raise _Refused(f'node "{node}" is not allowed to create pods with a non-nil configSource')
            forbidden = _forbidden_labels(_md(obj).get("labels") or {}, {})
            if forbidden:
                raise _Refused(f'node "{node}" is not allowed to set the following labels: {", ".join(forbidden)}')
        elif operation == "UPDATE":
            source = _spec(obj).get("configSource")
            if source is not None and source != _spec(old).get("configSource"):
                raise _Refused(f'node "{node}" is not allowed to update configSource to a new non-nil configSource')
            if (_spec(obj).get("taints") or None) != (_spec(old).get("taints") or None):
                raise _Refused(f'node "{node}" is not allowed to modify taints')
            forbidden = _forbidden_labels(_md(obj).get("labels") or {}, _md(old).get("labels") or {})
            if forbidden:
                raise _Refused(f"is not allowed to modify labels: {', '.join(forbidden)}")

    def _service_account(
        self,
        node: str,
        operation: str,
        subresource: str,
        namespace: str,
        name: str,
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
    ) -> None:
        if operation != "CREATE" or subresource != "token":
            return
        ref = _spec(obj).get("boundObjectRef")
        if (
            not isinstance(ref, dict)
            or ref.get("apiVersion") != "v1"
            or ref.get("kind") != "Pod"
            or not ref.get("name")
        ):
            raise _Refused("node requested token not bound to a pod")
        if not ref.get("uid"):
            raise _Refused("node requested token with a pod binding without a uid")
        pod = self.store.get(("", "pods"), (namespace, str(ref["name"])))
        if pod is None:
            raise errors.ApiError(
                404, "NotFound", f'pods "{ref["name"]}" not found', {"name": str(ref["name"]), "kind": "pods"}
            )
        if ref["uid"] != _md(pod).get("uid"):
            raise _Refused(
                f"the UID in the bound object reference ({ref['uid']}) does not match the UID in record. "
                "The object might have been deleted and then recreated"
            )
        if _spec(pod).get("nodeName") != node:
            raise _Refused("node requested token bound to a pod scheduled on a different node")

    def _lease(
        self,
        node: str,
        operation: str,
        subresource: str,
        namespace: str,
        name: str,
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
    ) -> None:
        if namespace != NODE_LEASE_NAMESPACE:
            raise _Refused(f'can only access leases in the "{NODE_LEASE_NAMESPACE}" system namespace')
        if (_md(obj).get("name") if operation == "CREATE" else name) != node:
            raise _Refused("can only access node lease with the same name as the requesting node")

    def _slice(
        self,
        node: str,
        operation: str,
        subresource: str,
        namespace: str,
        name: str,
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
    ) -> None:
        # updates are the Node authorizer's (the stored slice's node; spec.nodeName is immutable)
        if operation == "CREATE" and _spec(obj).get("nodeName") != node:
            raise _Refused("can only create ResourceSlice with the same NodeName as the requesting node")
        if operation == "DELETE" and _spec(old).get("nodeName") != node:
            raise _Refused("can only delete ResourceSlice with the same NodeName as the requesting node")


def _claim_statuses(pod: dict[str, Any] | None) -> list[tuple[Any, Any]]:
    statuses = ((pod or {}).get("status") or {}).get("resourceClaimStatuses") or []
    return [(s.get("name"), s.get("resourceClaimName")) for s in statuses if isinstance(s, dict)]
