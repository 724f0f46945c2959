"""Finalizers, deletionTimestamp, ownerReference cascades (background, foreground, orphan) and
namespace deletion, through kubernetes-asyncio; waits are on watch events, not sleeps."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.apiserver.testing import RunningApiServer
from tests.apiserver.conftest import wait_deleted


def count_sweeps(gc: Any) -> list[int]:
    """Count the garbage collector's full sweeps from now on: [count] (the list is updated in place)."""
    sweeps = [0]
    full_sweep = gc.sweep

    def counting() -> bool:
        sweeps[0] += 1
        return bool(full_sweep())

    gc.sweep = counting
    return sweeps


def owner_ref(obj, block: bool = False) -> dict:  # noqa: ANN001
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": obj.metadata.name,
        "uid": obj.metadata.uid,
        "blockOwnerDeletion": block,
    }


async def test_finalizer_holds_deletion_until_removed(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        await core.create_namespaced_config_map("default", {"metadata": {"name": "held", "finalizers": ["x/y"]}})
        w = watch.Watch()
        stream = w.stream(
            core.list_namespaced_config_map, "default", field_selector="metadata.name=held", timeout_seconds=30
        )
        assert (await asyncio.wait_for(stream.__anext__(), 5))["type"] == "ADDED"
        await core.delete_namespaced_config_map("held", "default")
        marked = await asyncio.wait_for(stream.__anext__(), 5)
        assert marked["type"] == "MODIFIED" and marked["object"].metadata.deletion_timestamp is not None
        still = await core.read_namespaced_config_map("held", "default")
        with pytest.raises(ApiException) as err:  # no new finalizers once deleting
            await core.patch_namespaced_config_map("held", "default", {"metadata": {"finalizers": ["x/y", "a/b"]}})
        assert err.value.status == 422
        still.metadata.finalizers = []
        await core.replace_namespaced_config_map("held", "default", still)
        types = [(await asyncio.wait_for(stream.__anext__(), 5))["type"] for _ in range(2)]
        assert types == ["MODIFIED", "DELETED"]
        await w.close()


async def test_background_cascade_deletes_dependents(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        owner = await core.create_namespaced_config_map("default", {"metadata": {"name": "owner"}})
        await core.create_namespaced_config_map(
            "default", {"metadata": {"name": "child", "ownerReferences": [owner_ref(owner)]}}
        )
        await core.create_namespaced_config_map("default", {"metadata": {"name": "bystander"}})
        await core.delete_namespaced_config_map("owner", "default")
        await wait_deleted(api, "", "configmaps", "default", "child")
        assert (await core.read_namespaced_config_map("bystander", "default")).metadata.name == "bystander"


async def test_foreground_deletion_waits_for_dependents(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        owner = await core.create_namespaced_config_map("default", {"metadata": {"name": "owner"}})
        await core.create_namespaced_config_map(
            "default",
            {
                "metadata": {
                    "name": "child",
                    "finalizers": ["test/hold"],
                    "ownerReferences": [owner_ref(owner, block=True)],
                }
            },
        )
        await core.delete_namespaced_config_map("owner", "default", propagation_policy="Foreground")
        marked = await core.read_namespaced_config_map("owner", "default")
        assert marked.metadata.deletion_timestamp and "foregroundDeletion" in marked.metadata.finalizers
        # The child is being deleted but its own finalizer holds it, so the owner stays.
        w = watch.Watch()
        child = None
        async for event in w.stream(
            core.list_namespaced_config_map, "default", field_selector="metadata.name=child", timeout_seconds=10
        ):
            if event["object"].metadata.deletion_timestamp:
                child = event["object"]
                break
        await w.close()
        assert child is not None and child.metadata.deletion_timestamp is not None
        assert (await core.read_namespaced_config_map("owner", "default")).metadata.name == "owner"
        child.metadata.finalizers = []
        await core.replace_namespaced_config_map("child", "default", child)
        await wait_deleted(api, "", "configmaps", "default", "owner")


async def test_orphan_deletion_keeps_dependents_without_the_reference(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        owner = await core.create_namespaced_config_map("default", {"metadata": {"name": "owner"}})
        await core.create_namespaced_config_map(
            "default", {"metadata": {"name": "child", "ownerReferences": [owner_ref(owner)]}}
        )
        await core.delete_namespaced_config_map("owner", "default", propagation_policy="Orphan")
        await wait_deleted(api, "", "configmaps", "default", "owner")
        child = await core.read_namespaced_config_map("child", "default")
        assert not child.metadata.owner_references


async def test_deleting_a_namespace_deletes_everything_in_it(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        res = client.ResourceV1Api(c)
        await core.create_namespace({"metadata": {"name": "doomed"}})
        await core.create_namespaced_config_map("doomed", {"metadata": {"name": "cm"}})
        await core.create_namespaced_config_map("doomed", {"metadata": {"name": "held", "finalizers": ["t/hold"]}})
        await res.create_namespaced_resource_claim(
            "doomed",
            {
                "metadata": {"name": "claim"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
            },
        )
        await core.delete_namespace("doomed")
        await wait_deleted(api, "", "configmaps", "doomed", "cm")
        await wait_deleted(api, "resource.k8s.io", "resourceclaims", "doomed", "claim")
        terminating = await core.read_namespace("doomed")  # held open by the finalizer
        assert terminating.status.phase == "Terminating" and terminating.metadata.deletion_timestamp
        with pytest.raises(ApiException) as err:
            await core.create_namespaced_config_map("doomed", {"metadata": {"name": "late"}})
        assert err.value.status == 403
        assert "because it is being terminated" in str(err.value.body)  # decoded to str by the client
        held = await core.read_namespaced_config_map("held", "doomed")
        assert held.metadata.deletion_timestamp is not None
        held.metadata.finalizers = []
        await core.replace_namespaced_config_map("held", "doomed", held)
        await wait_deleted(api, "", "namespaces", "", "doomed")
        assert (await core.list_namespaced_config_map("doomed")).items == []


async def test_graceful_pod_deletion_on_a_node_waits_for_the_kubelet(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        await core.create_node({"metadata": {"name": "n1"}})
        pod: dict[str, Any] = {
            "metadata": {"name": "p"},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]},
        }
        await core.create_namespaced_pod("default", pod)
        await core.delete_namespaced_pod("p", "default")
        marked = await core.read_namespaced_pod("p", "default")
        assert marked.metadata.deletion_timestamp and marked.metadata.deletion_grace_period_seconds == 30
        await core.delete_namespaced_pod("p", "default", grace_period_seconds=0)  # what the kubelet does
        await wait_deleted(api, "", "pods", "default", "p")
        # An unscheduled pod goes at once.
        await core.create_namespaced_pod("default", {**pod, "spec": {"containers": pod["spec"]["containers"]}})
        await core.delete_namespaced_pod("p", "default")
        await wait_deleted(api, "", "pods", "default", "p")


async def test_objects_created_with_owners_are_checked_alone(api: RunningApiServer) -> None:
    """A burst of owned creates costs no full sweep; one whose owner is gone (or another object by the
    same name: a different uid) is still deleted."""
    gc = api.server.gc
    sweeps = count_sweeps(gc)
    async with api.client() as c:
        core = client.CoreV1Api(c)
        owner = await core.create_namespaced_config_map("default", {"metadata": {"name": "owner"}})
        await asyncio.gather(
            *(
                core.create_namespaced_config_map(
                    "default", {"metadata": {"name": f"child-{i}", "ownerReferences": [owner_ref(owner)]}}
                )
                for i in range(30)
            )
        )
        await asyncio.wait_for(gc.idle.wait(), 10)
        assert sweeps[0] == 0
        assert len((await core.list_namespaced_config_map("default")).items) >= 31
        gone = {**owner_ref(owner), "uid": "0f7c61f2-0000-4000-8000-000000000000"}
        await core.create_namespaced_config_map("default", {"metadata": {"name": "stray", "ownerReferences": [gone]}})
        await wait_deleted(api, "", "configmaps", "default", "stray")
        await core.delete_namespaced_config_map("owner", "default")
        await core.create_namespaced_config_map("default", {"metadata": {"name": "owner"}})  # same name, new uid
        await core.create_namespaced_config_map(
            "default", {"metadata": {"name": "late", "ownerReferences": [owner_ref(owner)]}}
        )
        await wait_deleted(api, "", "configmaps", "default", "late")
        await wait_deleted(api, "", "configmaps", "default", "child-29")
        assert sweeps[0] > 0


async def test_deletions_are_checked_alone(api: RunningApiServer) -> None:
    """Deleted owners have only their dependents looked at, pods marked for deletion only themselves: a wave of
    pod deletes costs no full sweep, and still deletes each pod's dependent and a pod whose node is gone."""
    gc = api.server.gc
    sweeps = count_sweeps(gc)
    async with api.client() as c:
        core = client.CoreV1Api(c)
        await core.create_node({"metadata": {"name": "n1"}})
        containers = [{"name": "c", "image": "x"}]
        pods = await asyncio.gather(
            *(
                core.create_namespaced_pod(
                    "default", {"metadata": {"name": f"w-{i}"}, "spec": {"nodeName": "n1", "containers": containers}}
                )
                for i in range(10)
            )
        )
        for pod in pods:
            ref = {"apiVersion": "v1", "kind": "Pod", "name": pod.metadata.name, "uid": pod.metadata.uid}
            await core.create_namespaced_config_map(
                "default", {"metadata": {"name": f"{pod.metadata.name}-dep", "ownerReferences": [ref]}}
            )
        await core.create_namespaced_pod(
            "default", {"metadata": {"name": "lost"}, "spec": {"nodeName": "gone-node", "containers": containers}}
        )
        await asyncio.wait_for(gc.idle.wait(), 10)
        await asyncio.gather(*(core.delete_namespaced_pod(p.metadata.name, "default") for p in pods))
        await asyncio.gather(
            *(core.delete_namespaced_pod(p.metadata.name, "default", grace_period_seconds=0) for p in pods)
        )  # what the kubelet does
        await core.delete_namespaced_pod("lost", "default")  # no kubelet will finish it: its node does not exist
        for pod in pods:
            await wait_deleted(api, "", "configmaps", "default", f"{pod.metadata.name}-dep")
        await wait_deleted(api, "", "pods", "default", "lost")
        await asyncio.wait_for(gc.idle.wait(), 10)
        assert sweeps[0] == 0
