"""CRUD through kubernetes-asyncio over real HTTP: create/get/list/update/delete, 409s, generateName,
generation, status subresource, selectors, paging, 401, 404 and 422 Status bodies."""

from __future__ import annotations

import json

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.apiserver.testing import RunningApiServer


def slice_body(name: str, node: str = "node-a", driver: str = "gpu.nvidia.com", devices: int = 1) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name, "labels": {"node": node}},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": f"gpu-{i}"} for i in range(devices)],
        },
    }


def claim_body(name: str) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }


async def test_unauthenticated_request_gets_401_status(api: RunningApiServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{api.url}/api/v1/namespaces", ssl=False) as resp:
            assert resp.status == 401
            body = await resp.json()
        assert body["kind"] == "Status" and body["reason"] == "Unauthorized" and body["code"] == 401
        headers = {"Authorization": f"Bearer {api.token}"}
        async with http.get(f"{api.url}/api/v1/namespaces", ssl=False, headers=headers) as resp:
            assert resp.status == 200


async def test_resource_slice_crud_and_global_resource_version(api: RunningApiServer) -> None:
    async with api.client() as c:
        res = client.ResourceV1Api(c)
        first = await res.create_resource_slice(slice_body("s1"))
        second = await res.create_resource_slice(slice_body("s2", node="node-b"))
        assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
        assert first.metadata.uid and first.metadata.creation_timestamp and first.metadata.generation == 1
        got = await res.read_resource_slice("s1")
        assert got.spec.driver == "gpu.nvidia.com" and got.spec.devices[0].name == "gpu-0"
        listed = await res.list_resource_slice()
        assert [s.metadata.name for s in listed.items] == ["s1", "s2"]
        assert int(listed.metadata.resource_version) >= int(second.metadata.resource_version)

        got.spec.devices.append(client.V1Device(name="gpu-1"))
        updated = await res.replace_resource_slice("s1", got)
        assert len(updated.spec.devices) == 2 and updated.metadata.generation == 2

        await res.delete_resource_slice("s1")
        with pytest.raises(ApiException) as err:
            await res.read_resource_slice("s1")
        assert err.value.status == 404
        body = json.loads(err.value.body)
        assert body["reason"] == "NotFound"
        assert body["message"] == 'resourceslices.resource.k8s.io "s1" not found'
        assert body["details"] == {"name": "s1", "group": "resource.k8s.io", "kind": "resourceslices"}


async def test_stale_update_is_409_conflict_and_duplicate_create_is_409_already_exists(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        cm = await core.create_namespaced_config_map("default", {"metadata": {"name": "cfg"}, "data": {"a": "1"}})
        cm.data = {"a": "2"}
        await core.replace_namespaced_config_map("cfg", "default", cm)  # carries the old resourceVersion
        cm.data = {"a": "3"}
        with pytest.raises(ApiException) as err:
            await core.replace_namespaced_config_map("cfg", "default", cm)
        assert err.value.status == 409
        body = json.loads(err.value.body)
        assert body["reason"] == "Conflict"
        assert body["message"] == (
            'Operation cannot be fulfilled on configmaps "cfg": the object has been modified; '
            "please apply your changes to the latest version and try again"
        )
        with pytest.raises(ApiException) as err:
            await core.create_namespaced_config_map("default", {"metadata": {"name": "cfg"}})
        assert err.value.status == 409
        assert json.loads(err.value.body)["reason"] == "AlreadyExists"
        assert (await core.read_namespaced_config_map("cfg", "default")).data == {"a": "2"}


async def test_generate_name_and_missing_namespace(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        made = await core.create_namespaced_config_map("default", {"metadata": {"generateName": "cfg-"}})
        assert made.metadata.name.startswith("cfg-") and len(made.metadata.name) == len("cfg-") + 5
        with pytest.raises(ApiException) as err:
            await core.create_namespaced_config_map("nowhere", {"metadata": {"name": "x"}})
        assert err.value.status == 404
        assert json.loads(err.value.body)["message"] == 'namespaces "nowhere" not found'


async def test_status_subresource_is_separate_and_generation_tracks_spec_only(api: RunningApiServer) -> None:
    async with api.client() as c:
        res = client.ResourceV1Api(c)
        claim = await res.create_namespaced_resource_claim("default", claim_body("c1"))
        assert claim.status is None or claim.status.allocation is None
        assert claim.spec.devices.requests[0].exactly.allocation_mode == "ExactCount"  # server defaulting
        status = {
            "status": {
                "allocation": {
                    "devices": {
                        "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}]
                    }
                }
            }
        }
        patched = await res.patch_namespaced_resource_claim_status("c1", "default", status)
        assert patched.status.allocation.devices.results[0].device == "gpu-0"
        assert patched.metadata.generation == 1
        # Status sent to the main resource is ignored; metadata changes do not bump generation.
        patched.status = None
        patched.metadata.labels = {"a": "b"}
        again = await res.replace_namespaced_resource_claim("c1", "default", patched)
        assert again.status.allocation is not None and again.metadata.generation == 1
        assert again.metadata.labels == {"a": "b"}


async def test_label_and_field_selectors(api: RunningApiServer) -> None:
    async with api.client() as c:
        res = client.ResourceV1Api(c)
        for name, node, driver in (
            ("a", "n1", "gpu.nvidia.com"),
            ("b", "n2", "gpu.nvidia.com"),
            ("c", "n1", "compute-domain.nvidia.com"),
        ):
            await res.create_resource_slice(slice_body(name, node=node, driver=driver))
        names = lambda lst: [i.metadata.name for i in lst.items]  # noqa: E731
        assert names(await res.list_resource_slice(field_selector="spec.nodeName=n1")) == ["a", "c"]
        assert names(await res.list_resource_slice(field_selector="spec.driver=gpu.nvidia.com,spec.nodeName!=n1")) == [
            "b"
        ]
        assert names(await res.list_resource_slice(field_selector="metadata.name=b")) == ["b"]
        assert names(await res.list_resource_slice(label_selector="node in (n2)")) == ["b"]
        assert names(await res.list_resource_slice(label_selector="node!=n2")) == ["a", "c"]
        with pytest.raises(ApiException) as err:
            await res.list_resource_slice(field_selector="spec.pool=x")
        assert err.value.status == 400
        assert "field label not supported: spec.pool" in json.loads(err.value.body)["message"]

        core = client.CoreV1Api(c)
        for pod, node in (("p1", "n1"), ("p2", "n2")):
            await core.create_namespaced_pod(
                "default",
                {
                    "metadata": {"name": pod},
                    "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
                },
            )
        assert names(await core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n2")) == ["p2"]


async def test_limit_and_continue_paging(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        for i in range(7):
            await core.create_namespaced_config_map("default", {"metadata": {"name": f"cm-{i}"}})
        seen, token, pages = [], None, 0
        while True:
            page = await core.list_namespaced_config_map("default", limit=3, _continue=token)
            pages += 1
            seen += [i.metadata.name for i in page.items]
            token = page.metadata._continue
            if not token:
                break
            assert page.metadata.remaining_item_count == 7 - len(seen)
        assert pages == 3 and seen == [f"cm-{i}" for i in range(7)]


async def test_continue_token_older_than_history_is_410(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        for i in range(3):
            await core.create_namespaced_config_map("default", {"metadata": {"name": f"cm-{i}"}})
        page = await core.list_namespaced_config_map("default", limit=1)
        await core.create_namespaced_config_map("default", {"metadata": {"name": "later"}})
        api.server.store.compact()
        with pytest.raises(ApiException) as err:
            await core.list_namespaced_config_map("default", limit=1, _continue=page.metadata._continue)
        assert err.value.status == 410
        assert json.loads(err.value.body)["reason"] == "Expired"


async def test_invalid_slice_is_422_with_field_path_and_changes_nothing(api: RunningApiServer) -> None:
    async with api.client() as c:
        res = client.ResourceV1Api(c)
        with pytest.raises(ApiException) as err:
            await res.create_resource_slice(slice_body("big", devices=129))
        assert err.value.status == 422
        body = json.loads(err.value.body)
        assert body["reason"] == "Invalid" and body["code"] == 422
        assert body["message"].startswith('ResourceSlice.resource.k8s.io "big" is invalid: spec.devices: Too many: 129')
        assert [cause["field"] for cause in body["details"]["causes"]] == ["spec.devices"]
        assert (await res.list_resource_slice()).items == []


async def test_claim_spec_is_immutable(api: RunningApiServer) -> None:
    async with api.client() as c:
        res = client.ResourceV1Api(c)
        await res.create_namespaced_resource_claim("default", claim_body("c1"))
        patch = [{"op": "replace", "path": "/spec/devices/requests/0/name", "value": "other"}]
        with pytest.raises(ApiException) as err:
            await res.patch_namespaced_resource_claim("c1", "default", patch)
        assert err.value.status == 422
        assert json.loads(err.value.body)["details"]["causes"][0]["field"].startswith("spec")


async def test_v1beta1_reads_and_writes_share_one_storage_version(api: RunningApiServer) -> None:
    async with api.client() as c:
        v1 = client.ResourceV1Api(c)
        beta = client.ResourceV1beta1Api(c)
        await v1.create_namespaced_resource_claim("default", claim_body("c1"))
        old = await beta.read_namespaced_resource_claim("c1", "default")
        assert old.api_version == "resource.k8s.io/v1beta1"
        assert old.spec.devices.requests[0].device_class_name == "gpu.nvidia.com"
        await beta.create_resource_slice({**slice_body("s-beta"), "apiVersion": "resource.k8s.io/v1beta1"})
        again = await v1.read_resource_slice("s-beta")
        assert again.api_version == "resource.k8s.io/v1" and again.spec.devices[0].name == "gpu-0"


async def test_v1beta2_is_discovered_and_converts_with_v1_and_v1beta1(api: RunningApiServer) -> None:
    async with api.client() as c:
        group = await client.ApisApi(c).get_api_versions()
        (dra,) = [g for g in group.groups if g.name == "resource.k8s.io"]
        assert [v.version for v in dra.versions] == ["v1", "v1beta2", "v1beta1"]
        assert dra.preferred_version.version == "v1"
        kinds = await client.ResourceV1beta2Api(c).get_api_resources()
        assert {r.kind for r in kinds.resources if "/" not in r.name} == {
            "DeviceClass",
            "ResourceClaim",
            "ResourceClaimTemplate",
            "ResourceSlice",
        }
        beta2 = client.ResourceV1beta2Api(c)
        await beta2.create_resource_slice({**slice_body("s-beta2"), "apiVersion": "resource.k8s.io/v1beta2"})
        v1 = await client.ResourceV1Api(c).read_resource_slice("s-beta2")
        assert v1.api_version == "resource.k8s.io/v1" and v1.spec.devices[0].name == "gpu-0"
        beta1 = await client.ResourceV1beta1Api(c).read_resource_slice("s-beta2")
        assert beta1.spec.devices[0].basic is not None  # the v1beta1 shape
        await client.ResourceV1Api(c).create_namespaced_resource_claim("default", claim_body("c2"))
        claim = await beta2.read_namespaced_resource_claim("c2", "default")
        assert claim.api_version == "resource.k8s.io/v1beta2"
        assert claim.spec.devices.requests[0].exactly.device_class_name == "gpu.nvidia.com"
        listed = await beta2.list_resource_slice()
        assert listed.api_version == "resource.k8s.io/v1beta2" and [s.metadata.name for s in listed.items] == [
            "s-beta2"
        ]


async def test_leases_events_nodes_and_namespaced_kinds(api: RunningApiServer) -> None:
    async with api.client() as c:
        coord = client.CoordinationV1Api(c)
        lease = await coord.create_namespaced_lease(
            "kube-system",
            {"metadata": {"name": "leader"}, "spec": {"holderIdentity": "me", "leaseDurationSeconds": 15}},
        )
        lease.spec.holder_identity = "you"
        lease = await coord.replace_namespaced_lease("leader", "kube-system", lease)
        assert lease.spec.holder_identity == "you"
        core = client.CoreV1Api(c)
        await core.create_node({"metadata": {"name": "n1", "labels": {"gpu": "true"}}})
        await core.create_namespaced_event(
            "default",
            {
                "metadata": {"name": "e1"},
                "involvedObject": {"kind": "Node", "name": "n1"},
                "reason": "Ready",
                "message": "hi",
                "type": "Normal",
            },
        )
        events = await core.list_namespaced_event("default", field_selector="involvedObject.name=n1")
        assert [e.reason for e in events.items] == ["Ready"]
        nodes = await core.list_node(label_selector="gpu")
        assert [n.metadata.name for n in nodes.items] == ["n1"]


async def test_events_k8s_io_v1_events(api: RunningApiServer) -> None:
    async with api.client() as c:
        events = client.EventsV1Api(c)
        await events.create_namespaced_event(
            "default",
            {
                "apiVersion": "events.k8s.io/v1",
                "kind": "Event",
                "metadata": {"name": "e1"},
                "eventTime": "2026-01-01T00:00:00.000000Z",
                "reportingController": "gpu.nvidia.com/publisher",
                "reportingInstance": "p-0",
                "action": "Publish",
                "reason": "SlicePublished",
                "type": "Normal",
                "regarding": {"kind": "Node", "name": "n1"},
            },
        )
        found = await events.list_namespaced_event("default", field_selector="regarding.name=n1")
        assert [e.reason for e in found.items] == ["SlicePublished"]
