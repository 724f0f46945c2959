"""Discovery documents: /version, /api, /apis, /apis/<group>, the APIResourceLists per group
version, and aggregated discovery (apidiscovery.k8s.io/v2 APIGroupDiscoveryList) which kubectl
1.32 asks for first. Built from the live registry, so CRDs appear as soon as they are created."""

from __future__ import annotations

import hashlib
from typing import Any

from embedded.apiserver.resources import VERBS, Registry, Resource

SERVER_VERSION = {
    "major": "1",
    "minor": "34",
    "gitVersion": "v1.34.0-gpu-dra",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.24.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}

AGGREGATED_V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
AGGREGATED_V2BETA1 = "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList"

_SUBRESOURCE_VERBS = {
    "status": ["get", "patch", "update"],
    "scale": ["get", "patch", "update"],
    "binding": ["create"],
    "eviction": ["create"],
    "finalize": ["update"],
    "ephemeralcontainers": ["get", "patch", "update"],
    "token": ["create"],
}
_SUBRESOURCE_KIND = {
    "binding": ("", "v1", "Binding"),
    "eviction": ("policy", "v1", "Eviction"),
    "scale": ("autoscaling", "v1", "Scale"),
    "token": ("authentication.k8s.io", "v1", "TokenRequest"),
}


def wants_aggregated(accept: str) -> str | None:
    """The aggregated media type the client asked for first, if any (else the legacy documents)."""
    for media_range in accept.split(","):
        params = dict(p.strip().split("=", 1) for p in media_range.split(";")[1:] if "=" in p)
        if params.get("as") == "APIGroupDiscoveryList" and params.get("g") == "apidiscovery.k8s.io":
            if params.get("v") == "v2":
                return AGGREGATED_V2
            if params.get("v") == "v2beta1":
                return AGGREGATED_V2BETA1
    return None


def _storage_hash(res: Resource) -> str:
    return hashlib.sha256(f"{res.group}/{res.storage_version}/{res.kind}".encode()).hexdigest()[:11]


def api_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    }


def _group(name: str, versions: list[str]) -> dict[str, Any]:
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def api_group_list(registry: Registry) -> dict[str, Any]:
    groups = [_group(g, vs) for g, vs in registry.groups().items() if g]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def api_group(registry: Registry, name: str) -> dict[str, Any] | None:
    versions = registry.groups().get(name)
    if not versions or not name:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(name, versions)}


def resource_list(registry: Registry, group: str, version: str) -> dict[str, Any] | None:
    found = registry.in_group_version(group, version)
    if not found:
        return None
    resources: list[dict[str, Any]] = []
    for res in sorted(found, key=lambda r: r.plural):
        entry: dict[str, Any] = {
            "name": res.plural,
            "singularName": res.singular,
            "namespaced": res.namespaced,
            "kind": res.kind,
            "verbs": VERBS,
        }
        if res.short_names:
            entry["shortNames"] = res.short_names
        if res.categories:
            entry["categories"] = res.categories
        entry["storageVersionHash"] = _storage_hash(res)
        resources.append(entry)
        for sub in res.subresources:
            g, v, k = _SUBRESOURCE_KIND.get(sub, (res.group, version, res.kind))
            sub_entry: dict[str, Any] = {
                "name": f"{res.plural}/{sub}",
                "singularName": "",
                "namespaced": res.namespaced,
                "kind": k,
                "verbs": _SUBRESOURCE_VERBS.get(sub, ["get", "patch", "update"]),
            }
            if sub in _SUBRESOURCE_KIND:
                sub_entry["group"], sub_entry["version"] = g, v
            resources.append(sub_entry)
    gv = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}


def aggregated(registry: Registry, legacy: bool, media: str) -> dict[str, Any]:
    """APIGroupDiscoveryList for /api (legacy=True) or /apis."""
    items = []
    for group, versions in registry.groups().items():
        if bool(group) == legacy:
            continue
        version_entries = []
        for v in versions:
            resources = []
            for res in sorted(registry.in_group_version(group, v), key=lambda r: r.plural):
                entry: dict[str, Any] = {
                    "resource": res.plural,
                    "responseKind": {"group": res.group, "version": v, "kind": res.kind},
                    "scope": "Namespaced" if res.namespaced else "Cluster",
                    "singularResource": res.singular,
                    "verbs": VERBS,
                }
                if res.short_names:
                    entry["shortNames"] = res.short_names
                if res.categories:
                    entry["categories"] = res.categories
                if res.subresources:
                    subs = []
                    for sub in res.subresources:
                        g, sv, k = _SUBRESOURCE_KIND.get(sub, (res.group, v, res.kind))
                        subs.append(
                            {
                                "subresource": sub,
                                "responseKind": {"group": g, "version": sv, "kind": k},
                                "verbs": _SUBRESOURCE_VERBS.get(sub, ["get", "patch", "update"]),
                            }
                        )
                    entry["subresources"] = subs
                resources.append(entry)
            version_entries.append({"version": v, "resources": resources, "freshness": "Current"})
        items.append({"metadata": {"name": group, "creationTimestamp": None}, "versions": version_entries})
    api_version = "apidiscovery.k8s.io/v2" if media == AGGREGATED_V2 else "apidiscovery.k8s.io/v2beta1"
    return {"kind": "APIGroupDiscoveryList", "apiVersion": api_version, "metadata": {}, "items": items}
