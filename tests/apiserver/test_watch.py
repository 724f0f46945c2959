"""Watches through kubernetes-asyncio and raw HTTP: initial state, resume from a resourceVersion,
bookmarks, selector transitions, 410 Expired as an ERROR event, and the wire framing."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.apiserver.testing import RunningApiServer, running_apiserver
from tests.apiserver.test_crud import slice_body


async def _next(stream: watch.Watch) -> dict:
    return await asyncio.wait_for(stream.__anext__(), timeout=5)


async def test_watch_sees_initial_state_then_changes_in_order(api: RunningApiServer) -> None:
    async with api.client() as c:
        res = client.ResourceV1Api(c)
        await res.create_resource_slice(slice_body("s0"))
        w = watch.Watch()
        stream = w.stream(res.list_resource_slice, timeout_seconds=30)
        first = await _next(stream)
        assert (first["type"], first["object"].metadata.name) == ("ADDED", "s0")
        await res.create_resource_slice(slice_body("s1"))
        await res.patch_resource_slice("s1", {"metadata": {"labels": {"x": "y"}}})
        await res.delete_resource_slice("s0")
        seen = [await _next(stream) for _ in range(3)]
        assert [(e["type"], e["object"].metadata.name) for e in seen] == [
            ("ADDED", "s1"),
            ("MODIFIED", "s1"),
            ("DELETED", "s0"),
        ]
        rvs = [int(e["object"].metadata.resource_version) for e in seen]
        assert rvs == sorted(rvs) and len(set(rvs)) == 3
        w.stop()
        await w.close()


async def test_watch_resumes_from_a_resource_version(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        a = await core.create_namespaced_config_map("default", {"metadata": {"name": "a"}})
        await core.create_namespaced_config_map("default", {"metadata": {"name": "b"}})
        await core.delete_namespaced_config_map("a", "default")
        w = watch.Watch()
        stream = w.stream(
            core.list_namespaced_config_map, "default", resource_version=a.metadata.resource_version, timeout_seconds=30
        )
        events = [await _next(stream) for _ in range(2)]
        assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "b"), ("DELETED", "a")]
        await w.close()


async def test_expired_resource_version_is_410_error_event(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        old = await core.create_namespaced_config_map("default", {"metadata": {"name": "a"}})
        await core.create_namespaced_config_map("default", {"metadata": {"name": "b"}})
        api.server.store.compact()
        w = watch.Watch()
        stream = w.stream(
            core.list_namespaced_config_map,
            "default",
            resource_version=old.metadata.resource_version,
            timeout_seconds=5,
        )
        with pytest.raises(ApiException) as err:
            await _next(stream)
        assert err.value.status == 410
        assert "Expired: too old resource version" in (err.value.reason or "")
        await w.close()


async def test_raw_watch_framing_bookmarks_and_410_body(tmp_path) -> None:
    async with running_apiserver(tmp_path, bookmark_interval=0.2) as api:
        headers = {"Authorization": f"Bearer {api.token}"}
        url = f"{api.url}/apis/resource.k8s.io/v1/resourceslices"
        async with aiohttp.ClientSession(headers=headers) as http:
            async with http.post(url, json=slice_body("s1"), ssl=False) as resp:
                created = await resp.json()
            rv = created["metadata"]["resourceVersion"]
            params = {"watch": "true", "resourceVersion": rv, "allowWatchBookmarks": "true", "timeoutSeconds": "10"}
            async with http.get(url, params=params, ssl=False) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"] == "application/json"
                assert resp.headers.get("Transfer-Encoding") == "chunked"
                line = await asyncio.wait_for(resp.content.readline(), 5)
                event = json.loads(line)
                assert line.endswith(b"\n")
                assert event == {
                    "type": "BOOKMARK",
                    "object": {
                        "kind": "ResourceSlice",
                        "apiVersion": "resource.k8s.io/v1",
                        "metadata": {"resourceVersion": event["object"]["metadata"]["resourceVersion"]},
                    },
                }
                assert int(event["object"]["metadata"]["resourceVersion"]) >= int(rv)
            api.server.store.compact()
            async with http.post(url, json=slice_body("s2"), ssl=False) as resp:
                assert resp.status == 201
            params = {"watch": "true", "resourceVersion": "1"}
            async with http.get(url, params=params, ssl=False) as resp:
                assert resp.status == 200
                event = json.loads(await asyncio.wait_for(resp.content.readline(), 5))
                assert event["type"] == "ERROR"
                status = event["object"]
                assert status["kind"] == "Status" and status["code"] == 410 and status["reason"] == "Expired"
                assert status["message"].startswith("too old resource version: 1 (")
                assert await resp.content.readline() == b""


async def test_send_initial_events_ends_with_marked_bookmark(api: RunningApiServer) -> None:
    headers = {"Authorization": f"Bearer {api.token}"}
    async with api.client() as c:
        await client.ResourceV1Api(c).create_resource_slice(slice_body("s1"))
    url = f"{api.url}/apis/resource.k8s.io/v1/resourceslices"
    params = {
        "watch": "true",
        "sendInitialEvents": "true",
        "allowWatchBookmarks": "true",
        "resourceVersionMatch": "NotOlderThan",
        "timeoutSeconds": "5",
    }
    async with aiohttp.ClientSession(headers=headers) as http, http.get(url, params=params, ssl=False) as resp:
        added = json.loads(await asyncio.wait_for(resp.content.readline(), 5))
        marker = json.loads(await asyncio.wait_for(resp.content.readline(), 5))
    assert added["type"] == "ADDED" and added["object"]["metadata"]["name"] == "s1"
    assert marker["type"] == "BOOKMARK"
    assert marker["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


async def test_selector_transitions_become_added_and_deleted(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        await core.create_namespaced_config_map("default", {"metadata": {"name": "x", "labels": {"team": "a"}}})
        w = watch.Watch()
        stream = w.stream(core.list_namespaced_config_map, "default", label_selector="team=b", timeout_seconds=30)
        await core.patch_namespaced_config_map("x", "default", {"metadata": {"labels": {"team": "b"}}})
        assert (await _next(stream))["type"] == "ADDED"
        await core.patch_namespaced_config_map("x", "default", {"data": {"k": "v"}})
        assert (await _next(stream))["type"] == "MODIFIED"
        await core.patch_namespaced_config_map("x", "default", {"metadata": {"labels": {"team": "c"}}})
        gone = await _next(stream)
        assert gone["type"] == "DELETED" and gone["object"].metadata.labels == {"team": "c"}
        await w.close()


async def test_namespaced_watch_only_sees_its_namespace(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        await core.create_namespace({"metadata": {"name": "other"}})
        w = watch.Watch()
        stream = w.stream(core.list_namespaced_config_map, "default", timeout_seconds=30)
        await core.create_namespaced_config_map("other", {"metadata": {"name": "not-me"}})
        await core.create_namespaced_config_map("default", {"metadata": {"name": "me"}})
        event = await _next(stream)
        assert event["object"].metadata.name == "me"
        await w.close()
