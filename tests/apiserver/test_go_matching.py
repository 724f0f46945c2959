"""Names, label values, quantities and schema patterns are matched as the Go API server matches them: whole (a
trailing newline, which a Python `$` lets through, is refused) and with ASCII digits only (Python's `\\d` takes
every script's digits); such a value is refused with 422 and stores nothing, the plain value is accepted."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.apiserver.testing import RunningApiServer

STEP_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "steps.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {"plural": "steps", "singular": "step", "kind": "Step"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                # the NodeConfig CRD's memoryStep pattern (deploy/kubernetes/base/crds)
                                "properties": {
                                    "memoryStep": {"type": "string", "pattern": "^[0-9]+(Mi|Gi|Ti)$"},
                                    "count": {"type": "string", "pattern": "^\\d+$"},
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}


def _causes(err: ApiException) -> list[str]:
    return [c.get("field", "") for c in json.loads(err.body)["details"]["causes"]]


async def test_a_namespace_name_with_a_trailing_newline_is_refused(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        before = sorted(n.metadata.name for n in (await core.list_namespace()).items)
        with pytest.raises(ApiException) as err:
            await core.create_namespace({"metadata": {"name": "team-a\n"}})
        assert err.value.status == 422 and "metadata.name" in _causes(err.value)
        assert sorted(n.metadata.name for n in (await core.list_namespace()).items) == before
        made = await core.create_namespace({"metadata": {"name": "team-a"}})
        assert made.metadata.name == "team-a"


async def test_a_label_value_with_a_trailing_newline_is_refused(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        with pytest.raises(ApiException) as err:
            await core.create_namespaced_config_map("default", {"metadata": {"name": "cm", "labels": {"tier": "a\n"}}})
        assert err.value.status == 422 and _causes(err.value) == ["metadata.labels[tier]"]
        with pytest.raises(ApiException) as gone:
            await core.read_namespaced_config_map("cm", "default")
        assert gone.value.status == 404
        made = await core.create_namespaced_config_map("default", {"metadata": {"name": "cm", "labels": {"tier": "a"}}})
        assert made.metadata.labels == {"tier": "a"}


@pytest.mark.parametrize(
    ("field", "bad", "good"),
    [("memoryStep", "10Gi\n", "10Gi"), ("count", "١٢", "12")],  # `$` ends the value; `\\d` is 0-9
)
async def test_a_schema_pattern_is_matched_as_go_matches_it(
    api: RunningApiServer, field: str, bad: str, good: str
) -> None:
    async with api.client() as c:
        await client.ApiextensionsV1Api(c).create_custom_resource_definition(copy.deepcopy(STEP_CRD))
        custom = client.CustomObjectsApi(c)
        args = ("example.com", "v1", "default", "steps")

        def step(name: str, value: str) -> dict[str, Any]:
            return {"apiVersion": "example.com/v1", "kind": "Step", "metadata": {"name": name}, "spec": {field: value}}

        with pytest.raises(ApiException) as err:
            await custom.create_namespaced_custom_object(*args, step("bad", bad))
        assert err.value.status == 422 and _causes(err.value) == [f"spec.{field}"]
        assert (await custom.list_namespaced_custom_object(*args))["items"] == []
        made = await custom.create_namespaced_custom_object(*args, step("good", good))
        assert made["spec"][field] == good


async def test_a_quantity_in_other_digits_is_refused(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)

        def pod(name: str, memory: str) -> dict[str, Any]:
            container = {"name": "c", "image": "x", "resources": {"limits": {"memory": memory}}}
            return {"metadata": {"name": name}, "spec": {"containers": [container]}}

        with pytest.raises(ApiException) as err:
            await core.create_namespaced_pod("default", pod("bad", "١٠Gi"))
        assert err.value.status in (400, 422), err.value.body
        with pytest.raises(ApiException) as gone:
            await core.read_namespaced_pod("bad", "default")
        assert gone.value.status == 404
        made = await core.create_namespaced_pod("default", pod("good", "10Gi"))
        assert made.spec.containers[0].resources.limits == {"memory": "10Gi"}


async def test_a_json_patch_index_in_other_digits_is_a_clear_error(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        kept = {"name": "cm", "finalizers": ["example.com/kept"]}
        await core.create_namespaced_config_map("default", {"metadata": kept, "data": {"a": "1"}})
        for index in ("²", "١"):
            with pytest.raises(ApiException) as err:
                await core.patch_namespaced_config_map(
                    "cm",
                    "default",
                    [{"op": "replace", "path": f"/metadata/finalizers/{index}", "value": "example.com/x"}],
                    _content_type="application/json-patch+json",
                )  # type: ignore[call-arg]  # not in its stubs
            assert err.value.status in (400, 422) and "invalid array index" in str(err.value.body), err.value.body
        got = await core.read_namespaced_config_map("cm", "default")
        assert got.metadata.finalizers == ["example.com/kept"] and got.data == {"a": "1"}
