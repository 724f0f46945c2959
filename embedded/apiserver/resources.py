"""The registry of kinds the API server serves: group, versions, plural, scope, names, subresources.

Built-in kinds are declared here; CRDs add and remove entries at run time (see crds.py). A
`Resource` is keyed by (group, plural) and is served at every version in `versions`; objects are
stored at `storage_version`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]

# Field selectors every kind accepts; kinds add their own in `field_selectors`.
COMMON_FIELDS = ("metadata.name", "metadata.namespace")


@dataclass
class Resource:
    group: str
    versions: list[str]
    kind: str
    plural: str
    singular: str
    namespaced: bool
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    subresources: list[str] = field(default_factory=list)
    field_selectors: tuple[str, ...] = ()
    has_generation: bool = True
    storage_version: str = ""
    # CRD-only: version -> openAPIV3Schema, version -> printer columns, the CRD's name.
    schemas: dict[str, Any] = field(default_factory=dict)
    printer_columns: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    crd_name: str = ""

    def __post_init__(self) -> None:
        if not self.storage_version:
            self.storage_version = self.versions[0]

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def group_resource(self) -> str:
        """`pods` or `resourceclaims.resource.k8s.io`, as Status messages name it."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def api_version(self, version: str) -> str:
        return f"{self.group}/{version}" if self.group else version

    @property
    def is_custom(self) -> bool:
        return bool(self.crd_name)

    def allowed_fields(self) -> tuple[str, ...]:
        return COMMON_FIELDS + self.field_selectors


def _r(group: str, versions: str, kind: str, plural: str, namespaced: bool, **kw: Any) -> Resource:
    singular = kw.pop("singular", kind.lower())
    return Resource(group, versions.split(","), kind, plural, singular, namespaced, **kw)


POD_FIELDS = (
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
)
EVENT_FIELDS = (
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
)

BUILTIN: list[Resource] = [
    _r(
        "",
        "v1",
        "Namespace",
        "namespaces",
        False,
        short_names=["ns"],
        subresources=["status", "finalize"],
        field_selectors=("status.phase",),
        has_generation=False,
    ),
    _r(
        "",
        "v1",
        "Node",
        "nodes",
        False,
        short_names=["no"],
        subresources=["status"],
        field_selectors=("spec.unschedulable",),
        has_generation=False,
    ),
    _r(
        "",
        "v1",
        "Pod",
        "pods",
        True,
        short_names=["po"],
        categories=["all"],
        subresources=["status", "binding", "eviction", "ephemeralcontainers", "log"],
        field_selectors=POD_FIELDS,
    ),
    _r("", "v1", "Event", "events", True, short_names=["ev"], field_selectors=EVENT_FIELDS, has_generation=False),
    _r("", "v1", "ConfigMap", "configmaps", True, short_names=["cm"], has_generation=False),
    _r("", "v1", "Secret", "secrets", True, field_selectors=("type",), has_generation=False),
    _r(
        "",
        "v1",
        "ServiceAccount",
        "serviceaccounts",
        True,
        short_names=["sa"],
        subresources=["token"],
        has_generation=False,
    ),
    _r(
        "",
        "v1",
        "Service",
        "services",
        True,
        short_names=["svc"],
        categories=["all"],
        subresources=["status"],
        has_generation=False,
    ),
    _r(
        "apps",
        "v1",
        "Deployment",
        "deployments",
        True,
        short_names=["deploy"],
        categories=["all"],
        subresources=["status", "scale"],
    ),
    _r(
        "apps",
        "v1",
        "ReplicaSet",
        "replicasets",
        True,
        short_names=["rs"],
        categories=["all"],
        subresources=["status", "scale"],
        field_selectors=("status.replicas",),
    ),
    _r("apps", "v1", "DaemonSet", "daemonsets", True, short_names=["ds"], categories=["all"], subresources=["status"]),
    _r(
        "apps",
        "v1",
        "StatefulSet",
        "statefulsets",
        True,
        short_names=["sts"],
        categories=["all"],
        subresources=["status", "scale"],
    ),
    _r(
        "batch",
        "v1",
        "Job",
        "jobs",
        True,
        categories=["all"],
        subresources=["status"],
        field_selectors=("status.successful",),
    ),
    _r(
        "policy",
        "v1",
        "PodDisruptionBudget",
        "poddisruptionbudgets",
        True,
        short_names=["pdb"],
        subresources=["status"],
    ),
    _r("coordination.k8s.io", "v1", "Lease", "leases", True, has_generation=False),
    _r(
        "events.k8s.io",
        "v1",
        "Event",
        "events",
        True,
        has_generation=False,
        field_selectors=(
            "regarding.kind",
            "regarding.name",
            "regarding.namespace",
            "regarding.uid",
            "reason",
            "reportingController",
            "type",
        ),
    ),
    _r("rbac.authorization.k8s.io", "v1", "Role", "roles", True, has_generation=False),
    _r("rbac.authorization.k8s.io", "v1", "RoleBinding", "rolebindings", True, has_generation=False),
    _r("rbac.authorization.k8s.io", "v1", "ClusterRole", "clusterroles", False, has_generation=False),
    _r("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding", "clusterrolebindings", False, has_generation=False),
    _r("networking.k8s.io", "v1", "NetworkPolicy", "networkpolicies", True, short_names=["netpol"]),
    _r("networking.k8s.io", "v1", "Ingress", "ingresses", True, short_names=["ing"], subresources=["status"]),
    _r("networking.k8s.io", "v1", "IngressClass", "ingressclasses", False),
    _r(
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingWebhookConfiguration",
        "validatingwebhookconfigurations",
        False,
        categories=["api-extensions"],
    ),
    _r(
        "admissionregistration.k8s.io",
        "v1",
        "MutatingWebhookConfiguration",
        "mutatingwebhookconfigurations",
        False,
        categories=["api-extensions"],
    ),
    _r(
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingAdmissionPolicy",
        "validatingadmissionpolicies",
        False,
        categories=["api-extensions"],
        subresources=["status"],
    ),
    _r(
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingAdmissionPolicyBinding",
        "validatingadmissionpolicybindings",
        False,
        categories=["api-extensions"],
    ),
    _r(
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        False,
        short_names=["crd", "crds"],
        categories=["api-extensions"],
        subresources=["status"],
    ),
    _r("resource.k8s.io", "v1,v1beta2,v1beta1", "DeviceClass", "deviceclasses", False),
    _r("resource.k8s.io", "v1,v1beta2,v1beta1", "ResourceClaim", "resourceclaims", True, subresources=["status"]),
    _r("resource.k8s.io", "v1,v1beta2,v1beta1", "ResourceClaimTemplate", "resourceclaimtemplates", True),
    _r(
        "resource.k8s.io",
        "v1,v1beta2,v1beta1",
        "ResourceSlice",
        "resourceslices",
        False,
        field_selectors=("spec.nodeName", "spec.driver"),
    ),
]

# Groups in the order discovery lists them (the core group is served under /api).
GROUP_ORDER = [
    "",
    "apps",
    "batch",
    "policy",
    "coordination.k8s.io",
    "events.k8s.io",
    "rbac.authorization.k8s.io",
    "networking.k8s.io",
    "admissionregistration.k8s.io",
    "apiextensions.k8s.io",
    "resource.k8s.io",
]


class Registry:
    """Every served kind, by (group, plural) and by (group, version)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], Resource] = {}
        for res in BUILTIN:
            self.add(res)

    def add(self, res: Resource) -> None:
        self._by_key[res.key] = res

    def remove(self, group: str, plural: str) -> None:
        self._by_key.pop((group, plural), None)

    def get(self, group: str, version: str, plural: str) -> Resource | None:
        res = self._by_key.get((group, plural))
        if res is None or version not in res.versions:
            return None
        return res

    def by_key(self, group: str, plural: str) -> Resource | None:
        return self._by_key.get((group, plural))

    def by_kind(self, group: str, kind: str) -> Resource | None:
        for res in self._by_key.values():
            if res.group == group and res.kind == kind:
                return res
        return None

    def all(self) -> list[Resource]:
        return list(self._by_key.values())

    def groups(self) -> dict[str, list[str]]:
        """group -> served versions, preferred first, in discovery order."""
        found: dict[str, list[str]] = {}
        for res in self._by_key.values():
            versions = found.setdefault(res.group, [])
            for v in res.versions:
                if v not in versions:
                    versions.append(v)
        order = {g: i for i, g in enumerate(GROUP_ORDER)}
        return dict(sorted(found.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))

    def in_group_version(self, group: str, version: str) -> list[Resource]:
        return [r for r in self._by_key.values() if r.group == group and version in r.versions]
