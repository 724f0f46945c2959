"""Who each process of the local cluster is to its API server, and what it may do there.

Owns the identities: the product services run as deploy/'s ServiceAccounts (publisher,
controller, node agents) under deploy/'s RBAC and ValidatingAdmissionPolicies, installed as they
are shipped; the embedded components get what their upstream counterparts have, from roles
defined here (the scheduler like system:kube-scheduler, the workload controllers like
kube-controller-manager's, each kubelet with user `system:node:<node>` in group `system:nodes`, from a
static token file: the API server's Node authorizer and NodeRestriction give it its own node's objects,
and RBAC only what upstream's system:node grants beyond them). Every credential is a file (a kubeconfig per identity,
0600; the token file), never an argument a `ps` would show.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client

from embedded.cluster.apply import Applier, load_documents

DEPLOY_BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base"
RBAC_GROUP = "rbac.authorization.k8s.io"
TOKEN_SECONDS = 365 * 24 * 3600  # services do not refresh tokens; the cluster reissues them at every start


@dataclass(frozen=True)
class ServiceAccount:
    namespace: str
    name: str

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.name}"


# deploy/'s identities (rbac.yaml), and the embedded components' own (kube-system, as upstream's).
PUBLISHER = ServiceAccount("gpu-dra", "gpu-dra-publisher")
CONTROLLER = ServiceAccount("gpu-dra", "gpu-dra-controller")
NODE = ServiceAccount("gpu-dra", "gpu-dra-node")
DASHBOARD = ServiceAccount("gpu-dra", "gpu-dra-dashboard")
SCHEDULER = ServiceAccount("kube-system", "gpu-dra-scheduler")
WORKLOAD_CONTROLLERS = ServiceAccount("kube-system", "gpu-dra-controllers")


def _rule(groups: list[str], resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": groups, "resources": resources, "verbs": verbs}


_READ = ["get", "list", "watch"]
_WRITE = ["create", "update", "patch", "delete"]
_EVENTS = [
    _rule([""], ["events"], ["create", "patch", "update"]),
    _rule(["events.k8s.io"], ["events"], ["create", "patch", "update"]),
]

# What upstream grants its own components, cut to what the embedded ones touch.
EMBEDDED_ROLES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {
    # system:kube-scheduler + the DRA rules of its bootstrap policy
    "gpu-dra:embedded-scheduler": (
        [
            _rule([""], ["pods"], [*_READ, "delete"]),
            _rule([""], ["pods/binding"], ["create"]),
            _rule([""], ["pods/status"], ["patch", "update"]),
            _rule([""], ["nodes", "namespaces"], _READ),
            _rule(["resource.k8s.io"], ["resourceclaims"], [*_READ, *_WRITE]),
            _rule(["resource.k8s.io"], ["resourceclaims/status"], ["patch", "update"]),
            _rule(["resource.k8s.io"], ["resourceslices", "deviceclasses", "resourceclaimtemplates"], _READ),
            _rule(["coordination.k8s.io"], ["leases"], [*_READ, *_WRITE]),
            *_EVENTS,
        ],
        [{"kind": "ServiceAccount", "name": SCHEDULER.name, "namespace": SCHEDULER.namespace}],
    ),
    # kube-controller-manager's deployment, replicaset and job controllers
    "gpu-dra:embedded-workload-controllers": (
        [
            _rule(["apps"], ["deployments", "replicasets"], [*_READ, *_WRITE]),
            _rule(
                ["apps"],
                ["deployments/status", "replicasets/status", "deployments/finalizers", "replicasets/finalizers"],
                ["update", "patch"],
            ),
            _rule(["batch"], ["jobs"], [*_READ, *_WRITE]),
            _rule(["batch"], ["jobs/status", "jobs/finalizers"], ["update", "patch"]),
            _rule([""], ["pods"], [*_READ, *_WRITE]),
            _rule(["coordination.k8s.io"], ["leases"], [*_READ, *_WRITE]),
            *_EVENTS,
        ],
        [{"kind": "ServiceAccount", "name": WORKLOAD_CONTROLLERS.name, "namespace": WORKLOAD_CONTROLLERS.namespace}],
    ),
    # system:node's rules on what the Node authorizer does not subdivide (embedded/apiserver/nodeauthz.py):
    # nodes, pods, leases, ResourceSlices, ResourceClaims, secrets, configmaps and tokens are granted by it
    # alone, for the kubelet's own node, so that no rule here grants them again for every node
    "gpu-dra:embedded-kubelet": (
        [
            _rule([""], ["services"], _READ),
            _rule(["authentication.k8s.io"], ["tokenreviews"], ["create"]),
            _rule(["authorization.k8s.io"], ["subjectaccessreviews"], ["create"]),
            *_EVENTS,
        ],
        [{"apiGroup": RBAC_GROUP, "kind": "Group", "name": "system:nodes"}],
    ),
}


def embedded_rbac() -> list[dict[str, Any]]:
    """ServiceAccounts, ClusterRoles and ClusterRoleBindings of the embedded components."""
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa.name, "namespace": sa.namespace}}
        for sa in (SCHEDULER, WORKLOAD_CONTROLLERS)
    ]
    for name, (rules, subjects) in EMBEDDED_ROLES.items():
        objects.append(
            {"apiVersion": f"{RBAC_GROUP}/v1", "kind": "ClusterRole", "metadata": {"name": name}, "rules": rules}
        )
        objects.append(
            {
                "apiVersion": f"{RBAC_GROUP}/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": name},
                "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": name},
                "subjects": subjects,
            }
        )
    return objects


def deploy_objects(namespace: str = "gpu-dra") -> list[dict[str, Any]]:
    """deploy/'s RBAC and admission policies, as shipped, moved into `namespace` (as kustomize would)."""
    docs = [*load_documents(DEPLOY_BASE / "rbac.yaml"), *load_documents(DEPLOY_BASE / "admission.yaml")]
    for doc in docs:
        md = doc.setdefault("metadata", {})
        if "namespace" in md:
            md["namespace"] = namespace
        for subject in doc.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount":
                subject["namespace"] = namespace
    return docs


def kubelet_tokens(nodes: list[str]) -> dict[str, str]:
    """node -> a fresh token of its kubelet."""
    return {node: secrets.token_urlsafe(24) for node in nodes}


def token_file_text(kubelets: dict[str, str]) -> str:
    """kube-apiserver's --token-auth-file CSV for the kubelets (system:node:<node>, group system:nodes)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for node, token in kubelets.items():
        writer.writerow([token, f"system:node:{node}", f"kubelet-{node}", "system:nodes"])
    return out.getvalue()


def write_secret(path: Path, text: str) -> Path:
    """Write a credential file readable by its owner only (never briefly wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)
    return path


async def install(api: client.ApiClient, namespace: str = "gpu-dra") -> None:
    """deploy/'s RBAC and policies (create-or-keep), then the embedded components' roles (replaced: a data dir
    from an older version must not keep a kubelet role broader than today's)."""
    applier = Applier(api)
    for obj in await asyncio.to_thread(deploy_objects, namespace):
        await applier.create(obj, namespace)
    for obj in embedded_rbac():
        await applier.create_or_replace(obj, namespace)


async def service_account_token(api: client.ApiClient, sa: ServiceAccount) -> str:
    """A token for `sa` from the TokenRequest API, as `kubectl create token` gets one."""
    request = client.AuthenticationV1TokenRequest(
        api_version="authentication.k8s.io/v1",
        kind="TokenRequest",
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=TOKEN_SECONDS),
    )
    issued = await client.CoreV1Api(api).create_namespaced_service_account_token(sa.name, sa.namespace, request)
    return str(issued.status.token)


async def write_kubeconfig(admin_kubeconfig: Path, token: str, path: Path) -> Path:
    """The admin's kubeconfig (server, CA) with another identity's token, written 0600."""

    def build() -> Path:
        config = yaml.safe_load(admin_kubeconfig.read_text())
        for user in config.get("users") or []:
            user["user"] = {"token": token}
        # JSON, as the admin's (shared.kube.kubeconfig reads it without PyYAML; kubectl reads both)
        return write_secret(path, json.dumps(config, indent=2) + "\n")

    return await asyncio.to_thread(build)
