"""Claims a pod needs that nobody wrote: from its ResourceClaimTemplates and for its extended resources.

Owns what the resourceclaim controller does for templates (claim `<pod>-<entry>-xxxxx`, owned by
the pod as controller, annotation `resource.kubernetes.io/pod-claim-name`, pod
`status.resourceClaimStatuses`) and what kube-scheduler does for device-plugin style requests of a
resource named by a DeviceClass `spec.extendedResourceName` (one claim, one ExactCount request per
container and resource, pod `status.extendedResourceClaimStatus`). An existing generated claim is
found by owner uid + annotation first, so that restarts never create a second one.
"""

from __future__ import annotations

import copy
from typing import Any

from embedded.scheduler.state import EXTENDED_ANNOTATION, POD_CLAIM_ANNOTATION, ClusterState
from shared.kube.informer import key_of
from shared.kube.resources import PODS, RESOURCECLAIMS, RESOURCECLAIMTEMPLATES, Kube
from shared.kube.rest import ApiError
from shared.logs import get_logger

log = get_logger(__name__)
Obj = dict[str, Any]
IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"


def owner_ref(pod: Obj) -> Obj:
    md = pod["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": md["name"],
        "uid": md["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _prefix(pod_name: str, entry: str) -> str:
    # generateName + 5 random characters must stay a valid 253-character name; upstream cuts each part.
    return f"{pod_name[:28]}-{entry[:28]}-"


def extended_resource_classes(state: ClusterState) -> dict[str, str]:
    """Extended resource name -> DeviceClass (explicit spec.extendedResourceName and the implicit name)."""
    out: dict[str, str] = {}
    for name, cls in state.classes().items():
        out[IMPLICIT_PREFIX + name] = name
        explicit = (cls.get("spec") or {}).get("extendedResourceName")
        if explicit:
            out[str(explicit)] = name
    return out


def extended_requests(pod: Obj, by_resource: dict[str, str]) -> tuple[list[Obj], list[Obj]]:
    """(claim requests, requestMappings) for the pod's extended resources; empty when it has none."""
    requests: list[Obj] = []
    mappings: list[Obj] = []
    for ci, container in enumerate((pod.get("spec") or {}).get("containers") or []):
        res = container.get("resources") or {}
        wanted = {**(res.get("requests") or {}), **(res.get("limits") or {})}
        ri = 0
        for resource in sorted(wanted):
            if resource not in by_resource:
                continue
            try:
                count = int(str(wanted[resource]))
            except ValueError:
                continue  # a malformed quantity; the API server validates these
            if count <= 0:
                continue
            name = f"container-{ci}-request-{ri}"
            ri += 1
            requests.append(
                {
                    "name": name,
                    "exactly": {
                        "deviceClassName": by_resource[resource],
                        "allocationMode": "ExactCount",
                        "count": count,
                    },
                }
            )
            mappings.append({"containerName": container.get("name", ""), "resourceName": resource, "requestName": name})
    return requests, mappings


class ClaimGenerator:
    """Creates missing generated claims and records them in the pod's status."""

    def __init__(self, kube: Kube, state: ClusterState) -> None:
        self.kube = kube
        self.state = state

    async def ensure(self, pod: Obj) -> bool:
        """Make the pod's generated claims exist and be listed in its status; True when something was written."""
        wrote = await self._templates(pod)
        return await self._extended(pod) or wrote

    async def _templates(self, pod: Obj) -> bool:
        ns, pod_name = key_of(pod)
        entries = [e for e in (pod.get("spec") or {}).get("resourceClaims") or [] if e.get("resourceClaimTemplateName")]
        if not entries:
            return False
        current = {
            s.get("name"): s.get("resourceClaimName")
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
        }
        statuses: list[Obj] = []
        wrote = False
        for entry in entries:
            claim = self.state.generated_claim(pod, entry["name"])
            if claim is None:
                template = self.state.get(RESOURCECLAIMTEMPLATES, ns, entry["resourceClaimTemplateName"])
                if template is None:
                    continue  # the plan reports it as missing; the template's ADDED event retries
                claim = await self._create(pod, template, entry["name"])
                wrote = True
            statuses.append({"name": entry["name"], "resourceClaimName": claim["metadata"]["name"]})
        if statuses and any(current.get(s["name"]) != s["resourceClaimName"] for s in statuses):
            keep = [
                {"name": k, "resourceClaimName": v}
                for k, v in current.items()
                if k not in {s["name"] for s in statuses}
            ]
            updated = await self.kube.patch(
                PODS, ns, pod_name, {"status": {"resourceClaimStatuses": keep + statuses}}, subresource="status"
            )
            self.state.apply(PODS, "MODIFIED", updated)
            wrote = True
        return wrote

    async def _create(self, pod: Obj, template: Obj, entry: str) -> Obj:
        ns, pod_name = key_of(pod)
        tmeta = (template.get("spec") or {}).get("metadata") or {}
        annotations = {**(tmeta.get("annotations") or {}), POD_CLAIM_ANNOTATION: entry}
        body: Obj = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {
                "generateName": _prefix(pod_name, entry),
                "namespace": ns,
                "labels": dict(tmeta.get("labels") or {}),
                "annotations": annotations,
                "ownerReferences": [owner_ref(pod)],
            },
            "spec": copy.deepcopy((template.get("spec") or {}).get("spec") or {}),
        }
        created = await self.kube.create(RESOURCECLAIMS, ns, body)
        self.state.apply(RESOURCECLAIMS, "ADDED", created)
        log.info(
            "generated claim from template",
            pod=f"{ns}/{pod_name}",
            entry=entry,
            claim=created["metadata"]["name"],
            template=template["metadata"]["name"],
        )
        return created

    async def _extended(self, pod: Obj) -> bool:
        ns, pod_name = key_of(pod)
        requests, mappings = extended_requests(pod, extended_resource_classes(self.state))
        if not requests:
            return False
        claim = self.state.extended_claim(pod)
        wrote = False
        if claim is None:
            body: Obj = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {
                    "generateName": _prefix(pod_name, "extended-resources"),
                    "namespace": ns,
                    "annotations": {EXTENDED_ANNOTATION: "true"},
                    "ownerReferences": [owner_ref(pod)],
                },
                "spec": {"devices": {"requests": requests}},
            }
            claim = await self.kube.create(RESOURCECLAIMS, ns, body)
            self.state.apply(RESOURCECLAIMS, "ADDED", claim)
            log.info("generated claim for extended resources", pod=f"{ns}/{pod_name}", claim=claim["metadata"]["name"])
            wrote = True
        wanted = {"resourceClaimName": claim["metadata"]["name"], "requestMappings": mappings}
        if (pod.get("status") or {}).get("extendedResourceClaimStatus") != wanted:
            try:
                updated = await self.kube.patch(
                    PODS, ns, pod_name, {"status": {"extendedResourceClaimStatus": wanted}}, subresource="status"
                )
            except ApiError as exc:
                raise ApiError(
                    exc.status, exc.reason, f"writing extendedResourceClaimStatus of pod {ns}/{pod_name}: {exc.message}"
                ) from exc
            self.state.apply(PODS, "MODIFIED", updated)
            wrote = True
        return wrote
