"""Which objects each node may reach, as upstream's Node authorizer graph records them.

Owns the edges from the objects a bound pod names to the node it is bound to (node <- pod <- secret,
configmap, persistentvolumeclaim, serviceaccount, ResourceClaim), kept current from the store's change
feed: a pod's references are counted per node while it has `spec.nodeName`, and forgotten when it is
deleted or unbound. A ResourceClaim a pod gets from a template is the one its
`status.resourceClaimStatuses` names; the scheduler's extended-resource claim is
`status.extendedResourceClaimStatus.resourceClaimName`. Pods and ResourceSlices themselves are related
by their own `spec.nodeName`, read from the store. PersistentVolumes are not served here, so none is
related to any node.
"""

from __future__ import annotations

import collections
from typing import Any

from embedded.apiserver.storage import Change, ObjKey, Store

SECRET, CONFIGMAP, PVC, SERVICEACCOUNT, RESOURCECLAIM = "secret", "configmap", "pvc", "serviceaccount", "resourceclaim"
PV, POD, RESOURCESLICE = "pv", "pod", "resourceslice"
PODS = ("", "pods")
RESOURCESLICES = ("resource.k8s.io", "resourceslices")
Ref = tuple[str, str, str]  # (kind, namespace, name)


class NodeGraph:
    """The references of every bound pod, counted per node; `related` answers the authorizer's question."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pods: dict[ObjKey, tuple[str, frozenset[Ref]]] = {}
        self._edges: dict[Ref, collections.Counter[str]] = {}
        for key, pod in store.items(PODS):
            self._set(key, pod)
        store.add_listener(self._changed)

    def related(self, node: str, kind: str, namespace: str, name: str) -> bool:
        """Whether the object has a path to `node`: it is a pod or slice on it, or a pod on it names it."""
        if kind == POD:
            return _node_of(self.store.get(PODS, (namespace, name))) == node
        if kind == RESOURCESLICE:
            return _node_of(self.store.get(RESOURCESLICES, ("", name))) == node
        counts = self._edges.get((kind, namespace, name))
        return counts is not None and counts[node] > 0

    def _changed(self, change: Change) -> None:
        if change.res == PODS:
            self._set(change.key, None if change.type == "DELETED" else change.obj)

    def _set(self, key: ObjKey, pod: dict[str, Any] | None) -> None:
        node = _node_of(pod)
        refs = pod_references(pod) if pod is not None and node else frozenset()
        before = self._pods.get(key)
        if before == (node, refs):
            return
        if before is not None:
            old_node, old_refs = before
            for ref in old_refs:
                counts = self._edges[ref]
                counts[old_node] -= 1
                if counts[old_node] <= 0:
                    del counts[old_node]
                if not counts:
                    del self._edges[ref]
        if node and refs:
            self._pods[key] = (node, refs)
            for ref in refs:
                self._edges.setdefault(ref, collections.Counter())[node] += 1
        else:
            self._pods.pop(key, None)


def _node_of(obj: dict[str, Any] | None) -> str:
    spec = (obj or {}).get("spec")
    return str(spec.get("nodeName") or "") if isinstance(spec, dict) else ""


def _name(value: Any, key: str = "name") -> str:
    return str(value.get(key) or "") if isinstance(value, dict) else ""


def pod_references(pod: dict[str, Any]) -> frozenset[Ref]:
    """Every secret, configmap, PVC, ServiceAccount and ResourceClaim a pod names (the graph's edges to it)."""
    md = pod.get("metadata") or {}
    ns, pod_name = str(md.get("namespace") or ""), str(md.get("name") or "")
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    refs: set[Ref] = set()

    def add(kind: str, name: str) -> None:
        if name:
            refs.add((kind, ns, name))

    add(SERVICEACCOUNT, str(spec.get("serviceAccountName") or ""))
    for secret in spec.get("imagePullSecrets") or []:
        add(SECRET, _name(secret))
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(group) or []:
            for env in (container or {}).get("env") or []:
                source = (env or {}).get("valueFrom") or {}
                add(SECRET, _name(source.get("secretKeyRef")))
                add(CONFIGMAP, _name(source.get("configMapKeyRef")))
            for env_from in (container or {}).get("envFrom") or []:
                add(SECRET, _name((env_from or {}).get("secretRef")))
                add(CONFIGMAP, _name((env_from or {}).get("configMapRef")))
    for volume in spec.get("volumes") or []:
        if not isinstance(volume, dict):
            continue
        add(SECRET, _name(volume.get("secret"), "secretName"))
        add(CONFIGMAP, _name(volume.get("configMap")))
        add(PVC, _name(volume.get("persistentVolumeClaim"), "claimName"))
        if volume.get("ephemeral") and pod_name:
            add(PVC, f"{pod_name}-{volume.get('name', '')}")
        for source in ((volume.get("projected") or {}).get("sources")) or []:
            add(SECRET, _name((source or {}).get("secret")))
            add(CONFIGMAP, _name((source or {}).get("configMap")))
        for plugin in volume.values():  # csi, cephfs, rbd, iscsi, flexVolume...: a secretRef of their own
            if isinstance(plugin, dict):
                add(SECRET, _name(plugin.get("secretRef")) or _name(plugin.get("nodePublishSecretRef")))
        add(SECRET, _name(volume.get("azureFile"), "secretName"))
    generated = {
        _name(s): str(s.get("resourceClaimName") or "")
        for s in status.get("resourceClaimStatuses") or []
        if isinstance(s, dict)
    }
    for entry in spec.get("resourceClaims") or []:
        if isinstance(entry, dict):
            add(RESOURCECLAIM, str(entry.get("resourceClaimName") or "") or generated.get(_name(entry), ""))
    add(RESOURCECLAIM, _name(status.get("extendedResourceClaimStatus"), "resourceClaimName"))
    return frozenset(refs)
