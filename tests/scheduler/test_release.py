"""The scheduler's release of claims whose consumers are gone: a claim the garbage collector deletes (every owner a
pod that is gone: a deleted pod's generated claim) is left to it, with no write; any other claim is freed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embedded.apiserver.testing import running_apiserver
from embedded.scheduler.binding import Writer
from embedded.scheduler.state import ClusterState
from shared.kube.resources import PODS, RESOURCECLAIMS, Kube

GPU = {"deviceClassName": "gpu.nvidia.com"}
ALLOCATED = {
    "allocation": {
        "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-0", "device": "gpu-0"}]}
    }
}


async def reserved_claim(kube: Kube, name: str, pod: dict[str, Any], owned: bool) -> dict[str, Any]:
    md: dict[str, Any] = {"name": name, "namespace": "default"}
    if owned:
        md["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    made = await kube.create(
        RESOURCECLAIMS,
        "default",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": md,
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": GPU}]}},
        },
    )
    consumer = {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
    made["status"] = {**ALLOCATED, "reservedFor": [consumer]}
    return await kube.replace(RESOURCECLAIMS, made, subresource="status")


async def test_a_claim_the_garbage_collector_deletes_is_not_written_others_are_freed(tmp_path: Path) -> None:
    async with running_apiserver(tmp_path) as api, api.client() as client:
        kube = Kube(client)
        pod = await kube.create(
            PODS, "default", {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
        )
        generated = await reserved_claim(kube, "p-gpu", pod, owned=True)
        named = await reserved_claim(kube, "shared", pod, owned=False)
        state = ClusterState()
        state.replace_all(RESOURCECLAIMS, [generated, named])
        state.replace_all(PODS, [])  # the pod's DELETED event came; the garbage collector has not acted yet
        updates = api.server.requests.counts[("UPDATE", "resource.k8s.io", "resourceclaims", "status")]

        assert await Writer(kube, state).release()

        freed = await kube.get(RESOURCECLAIMS, "default", "shared")
        assert "allocation" not in freed["status"] and "reservedFor" not in freed["status"]
        untouched = await kube.get(RESOURCECLAIMS, "default", "p-gpu")
        assert untouched["metadata"]["resourceVersion"] == generated["metadata"]["resourceVersion"]
        assert api.server.requests.counts[("UPDATE", "resource.k8s.io", "resourceclaims", "status")] == updates + 1
