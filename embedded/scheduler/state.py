"""The scheduler's view of the cluster: cached objects per resource and the devices they hold.

Owns the caches (pods, claims, templates, slices, classes, nodes, namespaces) keyed by
`(namespace, name)`, the AllocatedState derived from the claims (updated per claim event and right
after each of our own writes, rebuilt on re-list), and the lookups that tie a pod to its claims.
An event older than the cached object (by resourceVersion) is ignored, so that a lagging watch
never undoes a write the scheduler has already applied.

A claim write the scheduler has decided but not yet sent is *assumed*: the claim as it will be
written is cached (its devices count as taken) until the write's answer, or any newer version of the
claim, replaces it; events and re-lists carrying the version it was assumed on (or an older one)
leave it in place. `forget` puts the claim as it was back when the write fails.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from embedded.scheduler.allocator import AllocatedState
from shared.kube.informer import key_of, resource_version
from shared.kube.resources import (
    DEVICECLASSES,
    NAMESPACES,
    NODES,
    PODS,
    RESOURCECLAIMS,
    RESOURCECLAIMTEMPLATES,
    RESOURCESLICES,
    Kube,
    Resource,
)

WATCHED: tuple[Resource, ...] = (
    PODS,
    RESOURCECLAIMS,
    RESOURCECLAIMTEMPLATES,
    RESOURCESLICES,
    DEVICECLASSES,
    NODES,
    NAMESPACES,
)
ADMIN_LABEL = "resource.kubernetes.io/admin-access"
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
EXTENDED_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
Key = tuple[str, str]
Obj = dict[str, Any]


def claim_key(obj: Obj) -> str:
    ns, name = key_of(obj)
    return f"{ns}/{name}"


class ClusterState:
    """Objects by resource plural, and the allocated devices."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[Key, Obj]] = {res.plural: {} for res in WATCHED}
        self.allocated = AllocatedState()
        self.arrival: dict[str, int] = {}  # pod uid -> order first seen (creationTimestamp has 1 s steps)
        self.assumed: dict[Key, int] = {}  # claim -> the resourceVersion its assumed write is based on
        self._arrivals = 0

    def _arrived(self, obj: Obj) -> None:
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if uid not in self.arrival:
            self._arrivals += 1
            self.arrival[uid] = self._arrivals

    def pod_order(self, pod: Obj) -> tuple[str, int]:
        """Creation order: creationTimestamp, then the order pods were seen in."""
        md = pod.get("metadata") or {}
        return str(md.get("creationTimestamp") or ""), self.arrival.get(str(md.get("uid") or ""), 0)

    # ---- updates -----------------------------------------------------------------------------------

    def replace_all(self, res: Resource, items: Iterable[Obj]) -> None:
        fresh = {key_of(o): o for o in items}
        if res is RESOURCECLAIMS:
            for key, base in list(self.assumed.items()):
                listed, assumed = fresh.get(key), self.objects[res.plural].get(key)
                if listed is not None and assumed is not None and (resource_version(listed) or 0) <= base:
                    fresh[key] = assumed  # the write is still on its way: keep counting its devices
                else:
                    del self.assumed[key]
        self.objects[res.plural] = fresh
        if res is PODS:
            for pod in sorted(items, key=lambda o: resource_version(o) or 0):
                self._arrived(pod)
        if res is RESOURCECLAIMS:
            self.allocated = AllocatedState.from_claims(self.objects[res.plural].values())

    def assume(self, claim: Obj) -> None:
        """Cache `claim` (with the resourceVersion of the cached one it was built from) before it is written."""
        key = key_of(claim)
        self.assumed[key] = resource_version(claim) or 0
        old = self.objects[RESOURCECLAIMS.plural].get(key)
        if old is not None:
            self.allocated.remove_claim(old)
        self.objects[RESOURCECLAIMS.plural][key] = claim
        self.allocated.add_claim(claim)

    def forget(self, original: Obj) -> None:
        """The assumed write of this claim failed: cache `original` (what it was assumed on) again, unless a
        newer version replaced the assumption meanwhile."""
        key = key_of(original)
        if self.assumed.pop(key, None) is None:
            return
        assumed = self.objects[RESOURCECLAIMS.plural].get(key)
        if assumed is not None:
            self.allocated.remove_claim(assumed)
        self.objects[RESOURCECLAIMS.plural][key] = original
        self.allocated.add_claim(original)

    def apply(self, res: Resource, event: str, obj: Obj) -> Obj | None:
        """Apply a watch event (ADDED/MODIFIED/DELETED) or a write's answer; the previous object, if any."""
        cache = self.objects[res.plural]
        key = key_of(obj)
        old = cache.get(key)
        if res is RESOURCECLAIMS and key in self.assumed:
            new_rv = resource_version(obj)
            if event != "DELETED" and new_rv is not None and new_rv <= self.assumed[key]:
                return old  # what the assumed write is based on, or older: the assumption stays
            del self.assumed[key]
        if old is not None and event != "DELETED":
            new_rv, old_rv = resource_version(obj), resource_version(old)
            if new_rv is not None and old_rv is not None and new_rv < old_rv:
                return old  # stale: we already hold a newer version
        if res is RESOURCECLAIMS and old is not None:
            self.allocated.remove_claim(old)
        if event == "DELETED":
            if old is not None and (old.get("metadata") or {}).get("uid") != (obj.get("metadata") or {}).get("uid"):
                # A deletion of an older incarnation: keep the new one.
                if res is RESOURCECLAIMS:
                    self.allocated.add_claim(old)
                return old
            cache.pop(key, None)
            if res is PODS:
                self.arrival.pop(str((obj.get("metadata") or {}).get("uid") or ""), None)
        else:
            cache[key] = obj
            if res is PODS:
                self._arrived(obj)
            if res is RESOURCECLAIMS:
                self.allocated.add_claim(obj)
        return old

    # ---- lookups -----------------------------------------------------------------------------------

    def get(self, res: Resource, namespace: str, name: str) -> Obj | None:
        return self.objects[res.plural].get((namespace, name))

    def values(self, res: Resource) -> list[Obj]:
        return list(self.objects[res.plural].values())

    def values_slices(self) -> list[Obj]:
        return self.values(RESOURCESLICES)

    def classes(self) -> dict[str, Obj]:
        return {name: obj for (_, name), obj in self.objects[DEVICECLASSES.plural].items()}

    def admin_namespaces(self) -> set[str]:
        return {
            name
            for (_, name), ns in self.objects[NAMESPACES.plural].items()
            if ((ns.get("metadata") or {}).get("labels") or {}).get(ADMIN_LABEL) == "true"
        }

    def owned_claims(self, pod: Obj) -> list[Obj]:
        """Claims whose controller owner is this pod (generated from a template or for extended resources)."""
        ns, _ = key_of(pod)
        uid = (pod.get("metadata") or {}).get("uid")
        out = []
        for (cns, _), claim in self.objects[RESOURCECLAIMS.plural].items():
            if cns != ns:
                continue
            refs = (claim.get("metadata") or {}).get("ownerReferences") or []
            if any(r.get("uid") == uid and r.get("controller") for r in refs):
                out.append(claim)
        return out

    def generated_claim(self, pod: Obj, entry: str) -> Obj | None:
        for claim in self.owned_claims(pod):
            if ((claim.get("metadata") or {}).get("annotations") or {}).get(POD_CLAIM_ANNOTATION) == entry:
                return claim
        return None

    def extended_claim(self, pod: Obj) -> Obj | None:
        for claim in self.owned_claims(pod):
            if ((claim.get("metadata") or {}).get("annotations") or {}).get(EXTENDED_ANNOTATION) == "true":
                return claim
        return None

    def pod_claim_names(self, pod: Obj) -> tuple[list[str], list[str]]:
        """(names of the pod's claims that exist, descriptions of those still missing)."""
        ns, _ = key_of(pod)
        status = pod.get("status") or {}
        by_entry = {s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []}
        names: list[str] = []
        missing: list[str] = []
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            name = entry.get("resourceClaimName") or by_entry.get(entry.get("name"))
            if not name:
                missing.append(
                    f"claim for entry {entry.get('name')!r} (template "
                    f"{entry.get('resourceClaimTemplateName')!r}) not generated yet"
                )
            elif self.get(RESOURCECLAIMS, ns, name) is None:
                missing.append(f"resourceclaim {ns}/{name} does not exist")
            else:
                names.append(name)
        ext = (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
        if ext:
            if self.get(RESOURCECLAIMS, ns, ext) is None:
                missing.append(f"extended-resource claim {ns}/{ext} does not exist")
            else:
                names.append(ext)
        return names, missing

    def pod_by_uid(self, uid: str) -> Obj | None:
        for pod in self.objects[PODS.plural].values():
            if (pod.get("metadata") or {}).get("uid") == uid:
                return pod
        return None


async def load_state(kube: Kube) -> ClusterState:
    """One list of every watched resource (what `gpu-dra explain` looks at)."""
    state = ClusterState()
    for res in WATCHED:
        items, _ = await kube.list(res)
        state.replace_all(res, items)
    return state
