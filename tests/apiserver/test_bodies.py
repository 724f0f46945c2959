"""Request bodies nested past the depth the server follows: upstream's 400 BadRequest ("exceeded max depth"),
never a RecursionError's 500, nothing stored, and the server goes on serving. Over raw HTTP, for each way a
body is decoded (JSON, YAML, the three patch types, server-side apply, DeleteOptions)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from embedded.apiserver.bodies import MAX_DEPTH
from embedded.apiserver.testing import RunningApiServer

CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
TOO_DEEP = (
    f"json parse error: exceeded max depth: the request body nests objects and arrays more than {MAX_DEPTH} levels deep"
)


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def configmap(depth: int) -> bytes:
    """A ConfigMap whose unknown field `x` makes the body `depth` + 1 objects deep."""
    return f'{{"apiVersion":"v1","kind":"ConfigMap","metadata":{{"name":"deep"}},"x":{nested(depth)}}}'.encode()


async def call(
    api: RunningApiServer, method: str, path: str, body: bytes | None, content_type: str = "application/json"
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method,
            api.url + path,
            data=body,
            ssl=False,
            headers={"Authorization": f"Bearer {api.token}", "Content-Type": content_type},
        ) as resp,
    ):
        text = await resp.text()
        return resp.status, json.loads(text) if text else None


async def test_a_body_nested_5000_levels_deep_is_a_400_and_stores_nothing(api: RunningApiServer) -> None:
    rv = api.server.store.rv
    for body, content_type in (
        (configmap(5000), "application/json"),
        (configmap(5000), "application/yaml"),
        (configmap(MAX_DEPTH), "application/json"),
    ):
        status, out = await call(api, "POST", CONFIGMAPS, body, content_type)
        assert (status, out["reason"], out["message"]) == (400, "BadRequest", TOO_DEEP), (content_type, out)
    assert api.server.store.rv == rv
    assert (await call(api, "GET", f"{CONFIGMAPS}/deep", None))[0] == 404

    # one level less is a body like any other, and the server goes on serving
    status, created = await call(api, "POST", CONFIGMAPS, configmap(MAX_DEPTH - 1))
    assert status == 201 and created["metadata"]["name"] == "deep" and "x" not in created  # unknown: dropped
    assert (await call(api, "GET", "/api/v1/namespaces", None))[0] == 200


async def test_patches_apply_and_delete_options_nested_too_deep_are_400s(api: RunningApiServer) -> None:
    status, _ = await call(api, "POST", CONFIGMAPS, b'{"metadata":{"name":"kept"},"data":{"k":"v"}}')
    assert status == 201
    rv = api.server.store.rv
    deep = f'{{"metadata":{{"labels":{nested(5000)}}}}}'.encode()
    for method, query, content_type in (
        ("PATCH", "", "application/merge-patch+json"),
        ("PATCH", "", "application/strategic-merge-patch+json"),
        ("PATCH", "", "application/json-patch+json"),
        ("PATCH", "?fieldManager=t", "application/apply-patch+yaml"),
        ("DELETE", "", "application/json"),
    ):
        status, out = await call(api, method, f"{CONFIGMAPS}/kept{query}", deep, content_type)
        assert (status, out["reason"], out["message"]) == (400, "BadRequest", TOO_DEEP), (method, content_type, out)
    assert api.server.store.rv == rv
    status, kept = await call(api, "GET", f"{CONFIGMAPS}/kept", None)
    assert status == 200 and kept["data"] == {"k": "v"}
