"""CRD then CR through kubernetes-asyncio: the kind is served once the CRD is stored, with schema
validation (422), the status subresource, generation, discovery, printer columns and deletion."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.apiserver.testing import RunningApiServer, running_apiserver

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {"size": {"type": "integer", "minimum": 1}},
                                "required": ["size"],
                            },
                            "status": {
                                "type": "object",
                                "properties": {
                                    "conditions": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "properties": {"type": {"type": "string"}, "status": {"type": "string"}},
                                        },
                                    }
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


async def _make_crd(c: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(c)
    await ext.create_custom_resource_definition(WIDGET_CRD)
    crd = await ext.read_custom_resource_definition("widgets.example.com")
    conditions = {cond.type: cond.status for cond in crd.status.conditions}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}
    assert crd.status.accepted_names.kind == "Widget" and crd.status.stored_versions == ["v1"]


async def test_crd_then_cr_with_status_subresource_and_validation(api: RunningApiServer) -> None:
    async with api.client() as c:
        await _make_crd(c)
        custom = client.CustomObjectsApi(c)
        args = ("example.com", "v1", "default", "widgets")
        made = await custom.create_namespaced_custom_object(
            *args,
            {
                "apiVersion": "example.com/v1",
                "kind": "Widget",
                "metadata": {"name": "w1"},
                "spec": {"size": 2},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            },
        )
        assert made["metadata"]["generation"] == 1 and "status" not in made  # status dropped on create

        with pytest.raises(ApiException) as err:
            await custom.create_namespaced_custom_object(
                *args,
                {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "bad"}, "spec": {"size": 0}},
            )
        assert err.value.status == 422
        body = json.loads(err.value.body)
        assert body["details"]["causes"][0]["field"] == "spec.size"

        status = await custom.patch_namespaced_custom_object_status(
            *args,
            "w1",
            {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
            _content_type="application/merge-patch+json",
        )  # type: ignore[call-arg]  # not in its stubs
        assert status["status"]["conditions"][0]["status"] == "True" and status["metadata"]["generation"] == 1
        spec = await custom.patch_namespaced_custom_object(
            *args,
            "w1",
            {"spec": {"size": 5}},  # type: ignore[call-arg]
            _content_type="application/merge-patch+json",
        )
        assert spec["metadata"]["generation"] == 2 and spec["status"]["conditions"][0]["type"] == "Ready"

        listed = await custom.list_namespaced_custom_object(*args)
        assert [i["metadata"]["name"] for i in listed["items"]] == ["w1"]
        assert listed["kind"] == "WidgetList"


async def test_crd_appears_in_discovery_and_tables_use_printer_columns(api: RunningApiServer) -> None:
    async with api.client() as c:
        await _make_crd(c)
        await client.CustomObjectsApi(c).create_namespaced_custom_object(
            "example.com",
            "v1",
            "default",
            "widgets",
            {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w1"}, "spec": {"size": 3}},
        )
    headers = {"Authorization": f"Bearer {api.token}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.get(f"{api.url}/apis/example.com/v1", ssl=False) as resp:
            doc = await resp.json()
        names = {r["name"]: r for r in doc["resources"]}
        assert names["widgets"]["kind"] == "Widget" and names["widgets"]["shortNames"] == ["wd"]
        assert "widgets/status" in names
        accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
        async with http.get(
            f"{api.url}/apis/example.com/v1/namespaces/default/widgets", ssl=False, headers={"Accept": accept}
        ) as resp:
            table = await resp.json()
        assert table["kind"] == "Table"
        assert [col["name"] for col in table["columnDefinitions"]] == ["Name", "Size", "Ready"]
        assert table["rows"][0]["cells"][:2] == ["w1", 3]
        assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"


async def test_deleting_the_crd_deletes_its_objects_and_stops_serving(api: RunningApiServer) -> None:
    async with api.client() as c:
        await _make_crd(c)
        custom = client.CustomObjectsApi(c)
        await custom.create_namespaced_custom_object(
            "example.com",
            "v1",
            "default",
            "widgets",
            {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w1"}, "spec": {"size": 3}},
        )
        await client.ApiextensionsV1Api(c).delete_custom_resource_definition("widgets.example.com")
        with pytest.raises(ApiException) as err:
            await custom.list_namespaced_custom_object("example.com", "v1", "default", "widgets")
        assert err.value.status == 404


async def test_upstream_compute_domain_crd_is_served(tmp_path: Path) -> None:
    path = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "computedomain-crd.yaml"
    crd = yaml.safe_load(path.read_text())
    async with running_apiserver(tmp_path) as api, api.client() as c:
        await client.ApiextensionsV1Api(c).create_custom_resource_definition(crd)
        group = crd["spec"]["group"]
        version = next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))
        plural = crd["spec"]["names"]["plural"]
        made = await client.CustomObjectsApi(c).create_namespaced_custom_object(
            group,
            version,
            "default",
            plural,
            {
                "apiVersion": f"{group}/{version}",
                "kind": crd["spec"]["names"]["kind"],
                "metadata": {"name": "cd1"},
                "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "cd1-channel"}}},
            },
        )
        assert made["metadata"]["name"] == "cd1"
