"""The pending-pods panel watches only the pods on no node, on the embedded API server: a waiting pod shows, leaves
the watch when it is bound, and no pod bound to a node (at creation or since) is kept, so the fleet's running pods'
status writes are never sent to the page."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from embedded.apiserver.testing import running_apiserver
from services.dashboard.pending import PendingPods
from shared.kube.client import kube_api_client
from shared.kube.resources import PODS, Kube, Resource
from tests.polling import eventually

pytestmark = [pytest.mark.timeout(60)]
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
NS = "team-a"


def pod(name: str, node: str = "") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            **({"nodeName": node} if node else {}),
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
            "containers": [{"name": "ctr", "image": "ubuntu", "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }


async def test_a_pod_leaves_the_watch_when_it_is_bound_and_pods_on_nodes_are_never_sent(tmp_path: Path) -> None:
    async with running_apiserver(tmp_path) as server:
        api = await kube_api_client(str(server.kubeconfig_path))
        kube = Kube(api)
        await kube.create(NAMESPACES, None, {"metadata": {"name": NS}})
        await kube.create(PODS, NS, pod("placed", node="gpu-node-0"))
        pending = PendingPods(kube, None, on_change=lambda: None)
        stopping = asyncio.Event()
        watching = asyncio.create_task(pending.informer.run(stopping))
        try:
            await asyncio.wait_for(pending.informer.synced.wait(), 20)
            assert set(pending.informer.objects) == set()  # listed with the selector: the bound pod is not there

            await kube.create(PODS, NS, pod("waiting"))
            await eventually(lambda: (NS, "waiting") in pending.pods, "the waiting pod on the panel", timeout=10)
            binding = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": "waiting", "namespace": NS},
                "target": {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-0"},
            }
            await kube.create_subresource(PODS, NS, "waiting", "binding", binding)
            await eventually(
                lambda: (NS, "waiting") not in pending.informer.objects and (NS, "waiting") not in pending.pods,
                "the bound pod gone from the watch and the panel",
                timeout=10,
            )

            # A pod created on a node never comes; one created after it, on no node, does (the watch is live).
            await kube.create(PODS, NS, pod("placed-later", node="gpu-node-1"))
            await kube.create(PODS, NS, pod("later"))
            await eventually(lambda: (NS, "later") in pending.pods, "the later waiting pod on the panel", timeout=10)
            assert set(pending.informer.objects) == {(NS, "later")}
        finally:
            stopping.set()
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            await api.close()
