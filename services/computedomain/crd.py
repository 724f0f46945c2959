"""The `resource.nvidia.com/v1beta1` CRDs as Python data, API-compatible with the upstream driver's.

Owns `computedomains.resource.nvidia.com` (spec immutable; `status` subresource) and, for clients
that expect it, `computedomaincliques.resource.nvidia.com` (this project does not write cliques:
membership lives in NATS KV). `gpu-dra up` and `deploy/` install what `crds()` returns. Also the
names the rest of the service uses for the group, version, plural, finalizer and labels.
"""

from __future__ import annotations

import copy
from typing import Any

GROUP = "resource.nvidia.com"
VERSION = "v1beta1"
PLURAL = "computedomains"
KIND = "ComputeDomain"
FINALIZER = "resource.nvidia.com/computeDomain"
LABEL_DOMAIN = "resource.nvidia.com/computeDomain"
LABEL_TARGET = "resource.nvidia.com/computeDomainTarget"
DRIVER = "compute-domain.nvidia.com"
CHANNEL_DEVICE_CLASS = "compute-domain-default-channel.nvidia.com"
DAEMON_DEVICE_CLASS = "compute-domain-daemon.nvidia.com"
CHANNEL_CONFIG_KIND = "ComputeDomainChannelConfig"
CONFIG_API_VERSION = "resource.nvidia.com/v1beta1"

_STATUS = {"type": "string", "enum": ["Ready", "NotReady"], "default": "NotReady"}
_INDEX = {
    "type": "integer",
    "description": "DNS index of the node's IMEX daemon within its clique; (cliqueID, index) is unique.",
}


def _meta_props() -> dict[str, Any]:
    return {
        "apiVersion": {"type": "string", "description": "APIVersion of this representation of an object."},
        "kind": {"type": "string", "description": "Kind of the REST resource this object represents."},
        "metadata": {"type": "object"},
    }


def _computedomain_schema() -> dict[str, Any]:
    node = {
        "type": "object",
        "description": "A node that is part of the ComputeDomain.",
        "properties": {
            "cliqueID": {"type": "string"},
            "index": _INDEX,
            "ipAddress": {"type": "string"},
            "name": {"type": "string"},
            "status": {**_STATUS, "description": "Readiness of the node's IMEX daemon."},
        },
        "required": ["cliqueID", "ipAddress", "name"],
    }
    return {
        "type": "object",
        "description": "ComputeDomain prepares a set of nodes to run a multi-node workload in.",
        "properties": {
            **_meta_props(),
            "spec": {
                "type": "object",
                "description": "ComputeDomainSpec provides the spec for a ComputeDomain.",
                "properties": {
                    "channel": {
                        "type": "object",
                        "description": "The IMEX channel a workload in the domain is given.",
                        "properties": {
                            "allocationMode": {
                                "type": "string",
                                "enum": ["All", "Single"],
                                "default": "Single",
                                "description": "Request all IMEX channels of the domain or precisely one.",
                            },
                            "resourceClaimTemplate": {
                                "type": "object",
                                "description": "The ResourceClaimTemplate the controller generates.",
                                "properties": {"name": {"type": "string"}},
                                "required": ["name"],
                            },
                        },
                        "required": ["resourceClaimTemplate"],
                    },
                    "numNodes": {
                        "type": "integer",
                        "minimum": 0,
                        "default": 0,
                        "description": "Deprecated. When non-zero, the domain reports Ready only once this many "
                        "nodes are Ready; it never gates daemon start-up or workload release.",
                    },
                },
                "required": ["channel"],
                "x-kubernetes-validations": [
                    {"rule": "self == oldSelf", "message": "A computeDomain.spec is immutable"}
                ],
            },
            "status": {
                "type": "object",
                "description": "Global ComputeDomain status, for debugging; workloads should not depend on it.",
                "properties": {
                    "nodes": {
                        "type": "array",
                        "items": node,
                        "x-kubernetes-list-type": "map",
                        "x-kubernetes-list-map-keys": ["name"],
                    },
                    "status": dict(_STATUS),
                },
                "required": ["status"],
            },
        },
    }


def _clique_schema() -> dict[str, Any]:
    daemon = {
        "type": "object",
        "description": "A daemon in a ComputeDomainClique.",
        "properties": {
            "cliqueID": {"type": "string"},
            "index": _INDEX,
            "ipAddress": {"type": "string"},
            "nodeName": {"type": "string"},
            "status": {**_STATUS, "description": "Readiness of the node's IMEX daemon."},
        },
        "required": ["cliqueID", "ipAddress", "nodeName"],
    }
    return {
        "type": "object",
        "description": "One clique of a ComputeDomain, named <computeDomainUID>.<cliqueID>.",
        "properties": {
            **_meta_props(),
            "daemons": {
                "type": "array",
                "items": daemon,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["nodeName"],
            },
        },
    }


def _crd(kind: str, plural: str, schema: dict[str, Any], status: bool) -> dict[str, Any]:
    version: dict[str, Any] = {"name": VERSION, "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}
    if status:
        version["subresources"] = {"status": {}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": plural[:-1]},
            "scope": "Namespaced",
            "versions": [version],
        },
    }


_CRDS = (
    _crd(KIND, PLURAL, _computedomain_schema(), status=True),
    _crd("ComputeDomainClique", "computedomaincliques", _clique_schema(), status=False),
)


def crds() -> list[dict[str, Any]]:
    """Fresh copies of the CRD objects to install (callers may mutate them)."""
    return copy.deepcopy(list(_CRDS))


def computedomain_crd() -> dict[str, Any]:
    return copy.deepcopy(_CRDS[0])
