"""HTTP-level behaviours clients rely on: dryRun, fieldValidation, pods/binding and eviction, the
scale subresource, deletecollection and preconditions, discovery (legacy and aggregated),
metadata-only lists, and clear errors for bad bodies and unknown paths."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.apiserver.testing import RunningApiServer
from tests.apiserver.test_crud import slice_body


class Http:
    def __init__(self, api: RunningApiServer, session: aiohttp.ClientSession) -> None:
        self.api, self.session = api, session

    async def __call__(
        self, method: str, path: str, body: Any = None, headers: dict | None = None, raw: bytes | None = None
    ) -> tuple[int, Any, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Authorization": f"Bearer {self.api.token}", "Content-Type": "application/json", **(headers or {})}
        async with self.session.request(method, self.api.url + path, data=data, headers=hdrs, ssl=False) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text else None), resp.headers


@pytest.fixture
async def http(api: RunningApiServer):  # noqa: ANN201
    async with aiohttp.ClientSession() as session:
        yield Http(api, session)


async def test_dry_run_validates_without_storing(http: Http) -> None:
    status, body, _ = await http("POST", "/apis/resource.k8s.io/v1/resourceslices?dryRun=All", slice_body("dry"))
    assert status == 201 and body["metadata"]["name"] == "dry"
    status, _, _ = await http("GET", "/apis/resource.k8s.io/v1/resourceslices/dry")
    assert status == 404
    status, body, _ = await http("POST", "/apis/resource.k8s.io/v1/resourceslices?dryRun=Maybe", slice_body("d"))
    assert status == 400 and "dryRun" in body["message"]


async def test_field_validation_strict_rejects_and_warn_prunes_unknown_fields(http: Http) -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"a": "b"}, "bogus": 1}
    status, body, _ = await http("POST", "/api/v1/namespaces/default/configmaps?fieldValidation=Strict", cm)
    assert status == 400 and body["reason"] == "BadRequest"
    assert 'strict decoding error: unknown field "bogus"' in body["message"]
    status, body, headers = await http("POST", "/api/v1/namespaces/default/configmaps?fieldValidation=Warn", cm)
    assert status == 201 and "bogus" not in body
    assert 'unknown field \\"bogus\\"' in headers["Warning"] or 'unknown field "bogus"' in headers["Warning"]


async def test_pod_binding_and_eviction(http: Http) -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    assert (await http("POST", "/api/v1/namespaces/default/pods", pod))[0] == 201
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "p"},
        "target": {"kind": "Node", "name": "n1"},
    }
    status, body, _ = await http("POST", "/api/v1/namespaces/default/pods/p/binding", binding)
    assert status == 201 and body["status"] == "Success"
    _, got, _ = await http("GET", "/api/v1/namespaces/default/pods/p")
    assert got["spec"]["nodeName"] == "n1"
    assert [c["type"] for c in got["status"]["conditions"]] == ["PodScheduled"]
    status, body, _ = await http("POST", "/api/v1/namespaces/default/pods/p/binding", binding)
    assert status == 409 and "already assigned" in body["message"]
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "p"},
        "deleteOptions": {"gracePeriodSeconds": 0},
    }
    assert (await http("POST", "/api/v1/namespaces/default/pods/p/eviction", eviction))[0] == 201
    assert (await http("GET", "/api/v1/namespaces/default/pods/p"))[0] == 404


async def test_pod_status_writes_keep_metadata_changes_other_kinds_do_not(http: Http) -> None:
    """As kube-apiserver's status strategies: pods/status resets only spec, deletionTimestamp and ownerReferences
    (a kubelet writes annotations with its status in one request); other kinds' status resets all metadata."""
    _, made, _ = await http("POST", "/api/v1/namespaces/default/configmaps", {"metadata": {"name": "o"}})
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "o", "uid": made["metadata"]["uid"]}
    pod = {
        "metadata": {"name": "s", "labels": {"a": "1"}, "ownerReferences": [owner]},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }
    assert (await http("POST", "/api/v1/namespaces/default/pods", pod))[0] == 201
    strategic = {"Content-Type": "application/strategic-merge-patch+json"}
    status, body, _ = await http(
        "PATCH",
        "/api/v1/namespaces/default/pods/s/status",
        {
            "metadata": {"annotations": {"x/edits": "{}"}, "labels": {"a": None, "b": "2"}, "ownerReferences": None},
            "spec": {"containers": [{"name": "c", "image": "y"}]},
            "status": {"phase": "Running"},
        },
        headers=strategic,
    )
    assert status == 200, body
    _, got, _ = await http("GET", "/api/v1/namespaces/default/pods/s")
    assert got["status"]["phase"] == "Running" and got["metadata"]["annotations"] == {"x/edits": "{}"}
    assert got["metadata"]["labels"] == {"b": "2"}
    assert got["metadata"]["ownerReferences"] == [owner] and got["spec"]["containers"][0]["image"] == "x"
    cm = {"metadata": {"name": "plain"}, "spec": {}}
    assert (
        await http(
            "POST",
            "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims",
            {**cm, "spec": {"devices": {"requests": []}}},
        )
    )[0] == 201
    status, body, _ = await http(
        "PATCH",
        "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/plain/status",
        {"metadata": {"annotations": {"x/edits": "{}"}}, "status": {}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert status == 200 and "annotations" not in body["metadata"], body


async def test_metrics_count_requests_by_verb_resource_and_subresource(http: Http) -> None:
    pod = {"metadata": {"name": "m"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    await http("POST", "/api/v1/namespaces/default/pods", pod)
    await http("GET", "/api/v1/namespaces/default/pods/m")
    await http("GET", "/api/v1/namespaces/default/pods/m")
    await http("GET", "/api/v1/pods")
    await http(
        "PATCH",
        "/api/v1/namespaces/default/pods/m/status",
        {"status": {"phase": "Running"}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    hdrs = {"Authorization": f"Bearer {http.api.token}"}
    async with http.session.get(http.api.url + "/metrics", headers=hdrs, ssl=False) as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        text = await resp.text()
    counts = {
        line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("apiserver_request_total{")
    }
    labels = 'apiserver_request_total{{verb="{}",group="",resource="pods",subresource="{}"}}'
    assert counts[labels.format("CREATE", "")] == 1 and counts[labels.format("GET", "")] == 2
    assert counts[labels.format("LIST", "")] == 1 and counts[labels.format("PATCH", "status")] == 1


async def test_scale_subresource(api: RunningApiServer) -> None:
    async with api.client() as c:
        apps = client.AppsV1Api(c)
        await apps.create_namespaced_deployment(
            "default",
            {
                "metadata": {"name": "d"},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": {"app": "d"}},
                    "template": {
                        "metadata": {"labels": {"app": "d"}},
                        "spec": {"containers": [{"name": "c", "image": "x"}]},
                    },
                },
            },
        )
        scale = await apps.read_namespaced_deployment_scale("d", "default")
        assert scale.spec.replicas == 1 and scale.status.selector == "app=d"
        await apps.patch_namespaced_deployment_scale("d", "default", {"spec": {"replicas": 3}})
        dep = await apps.read_namespaced_deployment("d", "default")
        assert dep.spec.replicas == 3 and dep.metadata.generation == 2


async def test_delete_collection_and_preconditions(api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        for name, team in (("a", "x"), ("b", "x"), ("c", "y")):
            await core.create_namespaced_config_map("default", {"metadata": {"name": name, "labels": {"team": team}}})
        await core.delete_collection_namespaced_config_map("default", label_selector="team=x")
        assert [i.metadata.name for i in (await core.list_namespaced_config_map("default")).items] == ["c"]
        with pytest.raises(ApiException) as err:
            await core.delete_namespaced_config_map(
                "c", "default", body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="not-the-uid"))
            )
        assert err.value.status == 409 and "Precondition failed" in json.loads(err.value.body)["message"]


async def test_discovery_documents(http: Http) -> None:
    status, version, _ = await http("GET", "/version")
    assert status == 200 and version["major"] == "1" and version["gitVersion"].startswith("v1.")
    _, groups, _ = await http("GET", "/apis")
    resource = next(g for g in groups["groups"] if g["name"] == "resource.k8s.io")
    assert [v["version"] for v in resource["versions"]] == ["v1", "v1beta2", "v1beta1"]
    assert resource["preferredVersion"]["version"] == "v1"
    status, slashed, _ = await http("GET", "/apis/")  # the trailing slash some clients send
    assert status == 200 and slashed == groups
    _, core, _ = await http("GET", "/api/v1")
    pods = next(r for r in core["resources"] if r["name"] == "pods")
    assert pods["namespaced"] and "watch" in pods["verbs"] and pods["shortNames"] == ["po"]
    accept = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json"
    status, agg, headers = await http("GET", "/apis", headers={"Accept": accept})
    assert status == 200 and headers["Content-Type"].startswith("application/json;g=apidiscovery.k8s.io;v=v2")
    assert agg["kind"] == "APIGroupDiscoveryList" and agg["apiVersion"] == "apidiscovery.k8s.io/v2"
    dra = next(i for i in agg["items"] if i["metadata"]["name"] == "resource.k8s.io")
    slices = next(r for r in dra["versions"][0]["resources"] if r["resource"] == "resourceslices")
    assert slices["scope"] == "Cluster" and slices["responseKind"]["kind"] == "ResourceSlice"


async def test_metadata_only_list(http: Http) -> None:
    await http("POST", "/apis/resource.k8s.io/v1/resourceslices", slice_body("s1"))
    accept = "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io"
    _, body, _ = await http("GET", "/apis/resource.k8s.io/v1/resourceslices", headers={"Accept": accept})
    assert body["kind"] == "PartialObjectMetadataList"
    assert body["items"][0] == {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": body["items"][0]["metadata"],
    }
    assert "spec" not in body["items"][0]


async def test_bad_requests_have_clear_status(http: Http) -> None:
    status, body, _ = await http("POST", "/api/v1/namespaces/default/configmaps", raw=b"{not json")
    assert status == 400 and body["kind"] == "Status" and "not valid JSON" in body["message"]
    status, body, _ = await http("GET", "/apis/example.com/v1/widgets")
    assert status == 404 and body["reason"] == "NotFound"
    status, body, _ = await http(
        "POST",
        "/api/v1/namespaces/default/configmaps",
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}},
    )
    assert status == 400 and "Secret" in body["message"]
    status, body, _ = await http(
        "PATCH",
        "/api/v1/namespaces/default/configmaps/none",
        {"data": {}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert status == 404
    status, body, _ = await http("POST", "/api/v1/namespaces/default/configmaps", {"metadata": {"name": "Bad_Name"}})
    assert status == 422 and body["details"]["causes"][0]["field"] == "metadata.name"
