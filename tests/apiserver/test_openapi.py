"""OpenAPI documents: shape checks, and kubectl (real binary) reading them over real HTTP for
`explain` and for server-side field validation detection."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from embedded.apiserver import openapi
from embedded.apiserver.openapi import (
    add_crd_schema,
    openapi_v2,
    openapi_v3_document,
    openapi_v3_index,
    remove_crd_schema,
)
from embedded.apiserver.resources import BUILTIN
from embedded.apiserver.testing import RunningApiServer

KUBECTL = shutil.which("kubectl")
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "description": "What the widget should be.",
                                "properties": {"size": {"type": "integer", "description": "Widget size in cm."}},
                            },
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}


def _gvk_of(schema: dict[str, Any]) -> list[dict[str, str]]:
    return schema.get("x-kubernetes-group-version-kind", [])


def test_index_lists_every_served_group_version_with_a_hash() -> None:
    paths = openapi_v3_index()["paths"]
    for gv in (
        "api/v1",
        "apis/apps/v1",
        "apis/resource.k8s.io/v1",
        "apis/resource.k8s.io/v1beta1",
        "apis/apiextensions.k8s.io/v1",
        "apis/coordination.k8s.io/v1",
    ):
        url = paths[gv]["serverRelativeURL"]
        assert url.startswith(f"/openapi/v3/{gv}?hash=")
        assert len(url.split("hash=")[1]) == 128  # sha512, upper-case hex like the real server
    assert openapi_v3_index() == openapi_v3_index()  # stable hashes: clients cache by URL


def test_resource_v1_document_has_kinds_refs_and_patch_operations() -> None:
    doc = openapi_v3_document("/openapi/v3/apis/resource.k8s.io/v1?hash=x")
    assert doc is not None and doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    slice_schema = schemas["io.k8s.api.resource.v1.ResourceSlice"]
    assert {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceSlice"} in _gvk_of(slice_schema)
    spec = schemas["io.k8s.api.resource.v1.ResourceSliceSpec"]
    assert spec["properties"]["devices"]["items"] == {"$ref": "#/components/schemas/io.k8s.api.resource.v1.Device"}
    assert spec["properties"]["nodeName"]["type"] == "string"  # no JSON-schema type lists in OpenAPI 3.0
    # every $ref resolves inside the document
    text = str(doc)
    for ref in {part.split("'")[0] for part in text.split("'$ref': '#/components/schemas/")[1:]}:
        assert ref in schemas, ref
    patch = doc["paths"]["/apis/resource.k8s.io/v1/resourceslices/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {
        "group": "resource.k8s.io",
        "version": "v1",
        "kind": "ResourceSlice",
    }
    assert "fieldValidation" in [p["name"] for p in patch["parameters"]]
    assert "application/strategic-merge-patch+json" in patch["requestBody"]["content"]
    assert schemas["io.k8s.apimachinery.pkg.api.resource.Quantity"]["type"] == "string"


def test_v1beta1_document_has_basic_device_and_unknown_paths_are_none() -> None:
    doc = openapi_v3_document("apis/resource.k8s.io/v1beta1")
    assert doc is not None
    assert "basic" in doc["components"]["schemas"]["io.k8s.api.resource.v1beta1.Device"]["properties"]
    assert openapi_v3_document("apis/resource.k8s.io/v9") is None
    assert openapi_v3_document("apis/nothing.example.com/v1") is None
    assert openapi_v3_document("not/a/path/at/all") is None


def test_crd_schema_joins_its_group_version_and_leaves_again() -> None:
    before = openapi_v3_index()["paths"]
    add_crd_schema(CRD)
    try:
        after = openapi_v3_index()["paths"]
        assert "apis/example.com/v1" in after
        assert after["api/v1"] == before["api/v1"]  # other documents keep their hash
        doc = openapi_v3_document("apis/example.com/v1")
        assert doc is not None
        widget = doc["components"]["schemas"]["com.example.v1.Widget"]
        assert _gvk_of(widget) == [{"group": "example.com", "version": "v1", "kind": "Widget"}]
        assert widget["properties"]["metadata"]["allOf"][0]["$ref"].endswith("meta.v1.ObjectMeta")
        patch = doc["paths"]["/apis/example.com/v1/namespaces/{namespace}/widgets/{name}"]["patch"]
        assert "application/strategic-merge-patch+json" not in patch["requestBody"]["content"]
        assert "/apis/example.com/v1/namespaces/{namespace}/widgets/{name}/status" in doc["paths"]
    finally:
        remove_crd_schema("widgets.example.com")
    assert "apis/example.com/v1" not in openapi_v3_index()["paths"]


def test_bad_crd_is_refused_with_the_missing_field() -> None:
    with pytest.raises(openapi.CrdSchemaError, match=r"spec\.names\.plural"):
        add_crd_schema(
            {"metadata": {"name": "x.example.com"}, "spec": {"group": "example.com", "names": {"kind": "X"}}}
        )


def test_swagger_v2_has_definitions_with_patch_metadata() -> None:
    doc = openapi_v2()
    assert doc["swagger"] == "2.0"
    pod_spec = doc["definitions"]["io.k8s.api.core.v1.PodSpec"]
    containers = pod_spec["properties"]["containers"]
    assert containers["x-kubernetes-patch-merge-key"] == "name"
    assert containers["items"]["$ref"] == "#/definitions/io.k8s.api.core.v1.Container"
    assert "io.k8s.api.resource.v1beta1.ResourceSlice" in doc["definitions"]


# -- kubectl against a tiny HTTP server that serves discovery plus these documents ----------------


def _discovery() -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    groups: dict[str, list[str]] = {}
    resources: dict[str, list[dict[str, Any]]] = {}
    crds = [
        (
            c["spec"]["group"],
            [v["name"] for v in c["spec"]["versions"]],
            c["spec"]["names"]["kind"],
            c["spec"]["names"]["plural"],
            c["spec"]["scope"] == "Namespaced",
        )
        for c in openapi._crds.values()
    ]
    builtin = [(r.group, r.versions, r.kind, r.plural, r.namespaced) for r in BUILTIN]
    for group, versions, kind, plural, namespaced in [*builtin, *crds]:
        for version in versions:
            gv = f"{group}/{version}" if group else version
            if group:
                groups.setdefault(group, [])
                if version not in groups[group]:
                    groups[group].append(version)
            resources.setdefault(gv, []).append(
                {
                    "name": plural,
                    "singularName": kind.lower(),
                    "namespaced": namespaced,
                    "kind": kind,
                    "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                }
            )
    api = {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
    }
    apis = {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [
            {
                "name": g,
                "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
            }
            for g, vs in groups.items()
        ],
    }
    lists = {
        gv: {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": rs}
        for gv, rs in resources.items()
    }
    return api, apis, lists


@pytest.fixture
async def kube_env(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    posted: list[dict[str, Any]] = []
    stored: dict[str, dict[str, Any]] = {}

    async def handle(request: web.Request) -> web.StreamResponse:
        path = request.path
        api, apis, lists = _discovery()
        if request.method in ("POST", "PATCH"):
            body = await request.json()
            posted.append(
                {"path": path, "query": dict(request.query), "body": body, "content_type": request.content_type}
            )
            if request.method == "POST":
                stored[f"{path}/{body['metadata']['name']}"] = body
                return web.json_response(body, status=201)
            return web.json_response(stored[path])
        if path in stored:
            return web.json_response(stored[path])
        if "/deviceclasses/" in path:
            return web.json_response(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "reason": "NotFound",
                    "code": 404,
                    "message": "not found",
                    "details": {"name": path.rsplit("/", 1)[1], "group": "resource.k8s.io", "kind": "deviceclasses"},
                },
                status=404,
            )
        if path == "/api":
            return web.json_response(api)
        if path == "/apis":
            return web.json_response(apis)
        if path == "/version":
            return web.json_response({"major": "1", "minor": "37", "gitVersion": "v1.37.0"})
        if path == "/openapi/v3":
            return web.json_response(openapi_v3_index())
        if path.startswith("/openapi/v3/"):
            found = openapi.openapi_v3_document_bytes(path)
            if found is None:
                raise web.HTTPNotFound()
            return web.Response(body=found[0], content_type="application/json")
        gv = path.removeprefix("/api/").removeprefix("/apis/")
        if gv in lists:
            return web.json_response(lists[gv])
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
        f"clusters: [{{name: t, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: t, user: {token: x}}]\n"
        "contexts: [{name: t, context: {cluster: t, user: t}}]\n"
    )
    try:
        yield {"kubeconfig": str(kubeconfig), "cache": str(tmp_path / "cache"), "posted": posted, "dir": str(tmp_path)}
    finally:
        await runner.cleanup()


async def _kubectl(env: dict[str, Any], *args: str) -> tuple[int, str]:
    assert KUBECTL is not None
    proc = await asyncio.create_subprocess_exec(
        KUBECTL,
        f"--kubeconfig={env['kubeconfig']}",
        f"--cache-dir={env['cache']}",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode or 0, out.decode()


@pytest.mark.kubectl
@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
async def test_kubectl_explain_reads_the_v3_documents(kube_env: dict[str, Any]) -> None:
    rc, out = await _kubectl(kube_env, "explain", "--api-version=resource.k8s.io/v1", "resourceslices.spec.devices")
    assert rc == 0, out
    assert "GROUP:      resource.k8s.io" in out and "KIND:       ResourceSlice" in out, out
    assert "VERSION:    v1\n" in out and "FIELD: devices <[]Device>" in out, out
    assert "attributes\t<map[string]DeviceAttribute>" in out, out
    rc, out = await _kubectl(
        kube_env, "explain", "--api-version=resource.k8s.io/v1beta1", "resourceslices.spec.devices.basic"
    )
    assert rc == 0, out
    assert "FIELD: basic <BasicDevice>" in out
    rc, out = await _kubectl(kube_env, "explain", "pods.spec.containers.resources.claims")
    assert rc == 0, out
    assert "ResourceClaim" in out


@pytest.mark.kubectl
@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
async def test_kubectl_sees_server_side_field_validation(kube_env: dict[str, Any]) -> None:
    # kubectl looks for `fieldValidation` on the kind's PATCH operation in the v3 document; when it
    # is there it leaves validation to the server and sends fieldValidation=Strict.
    manifest = Path(kube_env["dir"]) / "slice.yaml"
    manifest.write_text(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: s1}\n"
        "spec: {driver: gpu.nvidia.com, nodeName: n1, pool: {name: n1, generation: 1, resourceSliceCount: 1}}\n"
    )
    rc, out = await _kubectl(kube_env, "create", "-f", str(manifest))
    assert rc == 0, out
    (sent,) = kube_env["posted"]
    assert sent["path"] == "/apis/resource.k8s.io/v1/resourceslices"
    assert sent["query"].get("fieldValidation") == "Strict", sent["query"]


@pytest.mark.kubectl
@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
async def test_kubectl_apply_builds_a_strategic_merge_patch_from_the_v3_schema(kube_env: dict[str, Any]) -> None:
    # kubectl 1.32 has no compiled-in resource.k8s.io/v1 types: a strategic merge patch for a v1
    # DeviceClass can only come from the OpenAPI v3 document (otherwise it sends a JSON merge patch).
    manifest = Path(kube_env["dir"]) / "class.yaml"
    body = (
        "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {{name: gpu.nvidia.com}}\n"
        'spec: {{selectors: [{{cel: {{expression: "{}"}}}}]}}\n'
    )
    manifest.write_text(body.format("device.driver == 'gpu.nvidia.com'"))
    rc, out = await _kubectl(kube_env, "apply", "-f", str(manifest))
    assert rc == 0 and "created" in out, out
    manifest.write_text(body.format("device.driver == 'other.example.com'"))
    rc, out = await _kubectl(kube_env, "apply", "-f", str(manifest))
    assert rc == 0 and "warning" not in out.lower(), out
    create, patch = kube_env["posted"]
    assert create["query"].get("fieldValidation") == "Strict"
    assert patch["content_type"] == "application/strategic-merge-patch+json", patch
    assert patch["query"].get("fieldValidation") == "Strict"


@pytest.mark.kubectl
@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
async def test_kubectl_explain_reads_a_crd_schema(kube_env: dict[str, Any]) -> None:
    add_crd_schema(CRD)
    try:
        rc, out = await _kubectl(kube_env, "explain", "widgets.spec")
    finally:
        remove_crd_schema("widgets.example.com")
    assert rc == 0, out
    assert "KIND:       Widget" in out and "What the widget should be." in out, out
    assert "size\t<integer>" in out and "Widget size in cm." in out, out


async def test_openapi_v2_protobuf_is_a_gnostic_document(api: RunningApiServer) -> None:
    import aiohttp

    from embedded.apiserver import openapi_proto

    headers = {"Accept": openapi_proto.MEDIA_TYPE, "Authorization": f"Bearer {api.token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(api.url + "/openapi/v2", headers=headers, ssl=False) as reply,
    ):
        body = await reply.read()
        assert reply.status == 200 and reply.headers["Content-Type"] == openapi_proto.RESPONSE_TYPE
    assert body.startswith(b"\x0a\x032.0")  # Document.swagger (field 1) = "2.0"
    assert b"io.k8s.api.resource.v1.ResourceSlice" in body and b"x-kubernetes-group-version-kind" in body
