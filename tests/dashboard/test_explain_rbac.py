"""The fleet page's explain as deployed: the dashboard runs as deploy/'s `gpu-dra-dashboard` ServiceAccount
(its ClusterRole and binding from deploy/kubernetes/base/rbac.yaml applied to the embedded API server), a
tenant views with their own token (`--auth kubernetes`), over the real HTTP server.

A tenant's own pod is explained (200, with the reason); another tenant's is refused (403), and the claims of
namespaces the viewer may not see keep their names out of the text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from embedded.apiserver.testing import running_apiserver
from embedded.cluster.apply import Applier, load_documents
from embedded.cluster.dashboardtools import explainer
from services.dashboard.auth import KubernetesAuth
from services.dashboard.server import make_app, serve
from services.dashboard.state import FleetState, discover
from shared.kube.client import kube_api_client
from shared.kube.events import event_body
from shared.kube.resources import EVENTS, NODES, PODS, RESOURCECLAIMS, RESOURCESLICES, Kube, Resource

pytestmark = pytest.mark.timeout(90)
REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "kubernetes" / "base"
DASHBOARD = "gpu-dra-dashboard"
SERVICEACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount")
ROLES = Resource("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLEBINDINGS = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
PREPARE_ERROR = "Failed to prepare dynamic resources: NodePrepareResources failed: gpu-0 is being reset"


@dataclass
class Page:
    url: str
    http: aiohttp.ClientSession
    token: str  # a team-a viewer's

    async def explain(self, namespace: str, name: str) -> tuple[int, Any]:
        async with self.http.get(
            f"{self.url}/api/pod/{namespace}/{name}/explain", headers={"Authorization": f"Bearer {self.token}"}
        ) as resp:
            return resp.status, await resp.json()


async def token_of(kube: Kube, namespace: str, name: str) -> str:
    issued = await kube.create_subresource(
        SERVICEACCOUNTS, namespace, name, "token", {"spec": {"expirationSeconds": 3600}}
    )
    return str(issued["status"]["token"])


async def tenant_viewer(kube: Kube, namespace: str) -> str:
    """A ServiceAccount of `namespace` that may list its claims (what the dashboard asks about a viewer)."""
    await kube.create(SERVICEACCOUNTS, namespace, {"metadata": {"name": "viewer", "namespace": namespace}})
    await kube.create(
        ROLES,
        namespace,
        {
            "metadata": {"name": "claims", "namespace": namespace},
            "rules": [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["list", "get"]}],
        },
    )
    await kube.create(
        ROLEBINDINGS,
        namespace,
        {
            "metadata": {"name": "viewer", "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "claims"},
            "subjects": [{"kind": "ServiceAccount", "name": "viewer", "namespace": namespace}],
        },
    )
    return await token_of(kube, namespace, "viewer")


async def allocated_claim(kube: Kube, namespace: str, name: str, device: str, pod: dict[str, Any]) -> None:
    claim = await kube.create(
        RESOURCECLAIMS,
        namespace,
        {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        },
    )
    result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": device}
    await kube.replace(
        RESOURCECLAIMS,
        {
            **claim,
            "status": {
                "allocation": {"devices": {"results": [result]}},
                "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}],
            },
        },
        subresource="status",
    )


async def pod(kube: Kube, namespace: str, name: str, claim: str, node: str = "") -> dict[str, Any]:
    return await kube.create(
        PODS,
        namespace,
        {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                **({"nodeName": node} if node else {}),
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                "containers": [{"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
            },
        },
    )


async def the_cluster(kube: Kube, api: Any) -> None:
    """node-a with two GPUs; team-a's pod `stuck` bound there, its prepare failing; team-b's pod holds gpu-1;
    team-a's pod `waiting` wants both GPUs."""
    applier = Applier(api)
    for ns in ("gpu-dra", "team-a", "team-b"):
        await kube.create(NAMESPACES, None, {"metadata": {"name": ns}})
    for doc in load_documents(BASE / "rbac.yaml"):  # the dashboard's ServiceAccount, ClusterRole and binding
        if doc["metadata"]["name"] == DASHBOARD:
            await applier.create(doc, "gpu-dra")
    for doc in load_documents(BASE / "deviceclasses.yaml"):
        await applier.create(doc)
    await kube.create(
        NODES, None, {"metadata": {"name": "node-a"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    )
    gpus = [
        {"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": f"GPU-{i}"}}} for i in (0, 1)
    ]
    await kube.create(
        RESOURCESLICES,
        None,
        {
            "metadata": {"name": "node-a-gpu"},
            "spec": {
                "driver": "gpu.nvidia.com",
                "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": gpus,
            },
        },
    )
    stuck = await pod(kube, "team-a", "stuck", "stuck", node="node-a")
    await allocated_claim(kube, "team-a", "stuck", "gpu-0", stuck)
    involved = {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "team-a",
        "name": "stuck",
        "uid": stuck["metadata"]["uid"],
    }
    await kube.create(
        EVENTS,
        "team-a",
        event_body(
            involved,
            reason="FailedPrepareDynamicResources",
            message=PREPARE_ERROR,
            type="Warning",
            component="kubelet",
            instance="node-a",
        ),
    )
    theirs = await pod(kube, "team-b", "theirs", "theirs", node="node-a")
    await allocated_claim(kube, "team-b", "theirs", "gpu-1", theirs)
    await kube.create(
        RESOURCECLAIMS,
        "team-a",
        {
            "metadata": {"name": "both", "namespace": "team-a"},
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}}]}
            },
        },
    )
    await pod(kube, "team-a", "waiting", "both")


@pytest.fixture
async def page(tmp_path: Path) -> AsyncIterator[Page]:
    async with running_apiserver(tmp_path) as server:
        admin = await kube_api_client(str(server.kubeconfig_path))
        try:
            kube = Kube(admin)
            await the_cluster(kube, admin)
            viewer = await tenant_viewer(kube, "team-a")
            # The dashboard as deployed: its own ServiceAccount's token, nothing more.
            as_dashboard = server.server.write_kubeconfig(
                tmp_path / "dashboard.kubeconfig", token=await token_of(kube, "gpu-dra", DASHBOARD)
            )
            api = await kube_api_client(str(as_dashboard))
            try:
                state = FleetState(Kube(api), **await discover(Kube(api)))
                stopping, synced = asyncio.Event(), asyncio.Event()
                watching = asyncio.create_task(state.run(stopping, synced))
                try:
                    await asyncio.wait_for(synced.wait(), 20)
                    app = make_app(state, auth=KubernetesAuth(api), explainer=explainer(str(as_dashboard)))
                    async with serve(app, "127.0.0.1:0") as (host, port), aiohttp.ClientSession() as http:
                        yield Page(f"http://{host}:{port}", http, viewer)
                finally:
                    stopping.set()
                    await watching
            finally:
                await api.close()
        finally:
            await admin.close()


async def test_a_tenant_explains_their_own_pods_and_not_another_tenants(page: Page) -> None:
    status, body = await page.explain("team-a", "stuck")
    assert status == 200, body
    assert "pod team-a/stuck: bound to node node-a" in body["text"]
    assert "prepare on node node-a failed (1x, last at " in body["text"] and PREPARE_ERROR in body["text"]
    assert "node node-a: Ready=True" in body["text"]

    status, body = await page.explain("team-a", "waiting")
    assert status == 200, body
    text = body["text"]
    assert "pod team-a/waiting: not scheduled" in text and "node node-a: does not fit" in text
    assert "already allocated to claim team-a/stuck" in text  # the viewer's own claim, named
    assert "already allocated to another tenant's claim" in text and "team-b" not in text

    status, body = await page.explain("team-b", "theirs")
    assert status == 403 and "team-b" in body["error"]
