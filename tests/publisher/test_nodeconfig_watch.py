"""NodeConfig objects, live: the real publisher watches them on the embedded API server (with the shipped
CRD) and re-publishes the slices of the nodes a change concerns, at once; a bad object is refused
(status, Warning Event) and the last good config stays; a deleted one gives the default back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

import embedded.apiserver.testing as apiserver_testing
from embedded.harness.discovery import running_discovery
from embedded.harness.publisher import node_slices, running_publisher, until
from services.publisher.nodeconfigs import INVALID
from shared.kube import rest as kube
from shared.kube.client import kube_api_client
from shared.kube.resources import EVENTS, RESOURCESLICES, Kube
from shared.nodeconfig_objects import NODECONFIGS

CRD = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base" / "crds" / "nodeconfigs.yaml"
Obj = dict[str, Any]


@pytest.fixture
async def api(tmp_path):
    async with apiserver_testing.running_apiserver(tmp_path / "api") as server:
        client = await kube_api_client(str(server.kubeconfig_path))
        try:
            await kube.request(
                client,
                "POST",
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                body=yaml.safe_load(CRD.read_text()),
            )
            server.client_raw = client  # type: ignore[attr-defined]
            yield server
        finally:
            await client.close()


def rule(**what: Any) -> Obj:
    return {"name": "tenants", "nodeSelector": {"matchLabels": {"pool": "a"}}, **what}


def nodeconfig(*rules: Obj, name: str = "tenants") -> Obj:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "NodeConfig",
        "metadata": {"name": name},
        "spec": {"rules": list(rules)},
    }


async def wait_for(k: Kube, res: Any, pred: Callable[[Obj], bool], *, rv: str = "", timeout: float = 10.0) -> Obj:
    """The first object of `res` for which `pred` holds: one already there (when `rv` is not given), or the
    first watch event from `rv` (or from the list) that makes it hold. No polling."""
    async with asyncio.timeout(timeout):
        if not rv:
            items, rv = await k.list(res)
            for obj in items:
                if pred(obj):
                    return obj
        while True:
            async for event, obj in k.watch(res, rv, timeout_s=30):
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if event in ("ADDED", "MODIFIED") and pred(obj):
                    return obj


def condition(obj: Obj, type_: str) -> Obj:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def status_is(name: str, generation: int, **want: str) -> Callable[[Obj], bool]:
    def pred(obj: Obj) -> bool:
        return (
            obj["metadata"]["name"] == name
            and obj["metadata"].get("generation") == generation
            and obj.get("status", {}).get("observedGeneration") == generation
            and all(
                condition(obj, t).get("status") == s and condition(obj, t).get("observedGeneration") == generation
                for t, s in want.items()
            )
        )

    return pred


def gpu_slice_of(node: str, pred: Callable[[list[Obj]], bool]) -> Callable[[Obj], bool]:
    def check(obj: Obj) -> bool:
        spec = obj.get("spec") or {}
        return spec.get("nodeName") == node and spec.get("driver") == "gpu.nvidia.com" and pred(spec["devices"])

    return check


def shares(n: int) -> Callable[[list[Obj]], bool]:
    return lambda devices: all(
        d.get("allowMultipleAllocations") is True and d["capacity"].get("shares", {}).get("value") == str(n)
        for d in devices
    )


def exclusive(devices: list[Obj]) -> bool:
    return all(
        "allowMultipleAllocations" not in d
        and "shares" not in d["capacity"]
        and "requestPolicy" not in d["capacity"]["memory"]
        for d in devices
    )


async def _node(client: Any, name: str, labels: dict[str, str]) -> None:
    await kube.request(
        client,
        "POST",
        "/api/v1/nodes",
        body={"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}},
    )


async def rvs(client: Any, node: str) -> dict[str, str]:
    return {
        s["metadata"]["name"]: s["metadata"]["resourceVersion"]
        for driver in ("gpu.nvidia.com", "compute-domain.nvidia.com")
        for s in await node_slices(client, node, driver)
    }


async def test_a_nodeconfig_change_republishes_only_its_nodes_a_bad_one_is_refused_and_deletion_restores(
    bus, api, nats_server, tmp_path
):
    client = api.client_raw
    k = Kube(client)
    await _node(client, "a", {"pool": "a"})
    await _node(client, "b", {"pool": "b"})
    async with (
        running_publisher(nats_server.url, str(api.kubeconfig_path)) as pub,
        running_discovery(bus, node="a", simulate="h100x2", root=tmp_path / "a"),
        running_discovery(bus, node="b", simulate="h100x2", root=tmp_path / "b"),
    ):

        async def published() -> bool:
            return [len(await node_slices(client, n)) for n in ("a", "b")] == [1, 1]

        await until(pub, published)
        assert exclusive((await node_slices(client, "a"))[0]["spec"]["devices"])

        # created: node a's GPUs become 8 shares each
        await k.create(NODECONFIGS, None, nodeconfig(rule(sharing="shares", maxShares=8)))
        await wait_for(k, RESOURCESLICES, gpu_slice_of("a", shares(8)))
        await wait_for(k, NODECONFIGS, status_is("tenants", 1, Accepted="True", Applied="True"))
        b_before = await rvs(client, "b")

        # changed to 4: a's slices follow within 1 s (update -> slice event), b's are not written
        _, list_rv = await k.list(RESOURCESLICES)
        began = time.monotonic()
        await k.patch(NODECONFIGS, None, "tenants", {"spec": {"rules": [rule(sharing="shares", maxShares=4)]}})
        await wait_for(k, RESOURCESLICES, gpu_slice_of("a", shares(4)), rv=list_rv)
        latency = time.monotonic() - began
        print(f"\nNodeConfig update -> node a's slice changed: {latency * 1000:.1f} ms")
        assert latency < 1.0
        changed = await wait_for(k, NODECONFIGS, status_is("tenants", 2, Accepted="True", Applied="True"))
        await pub.idle()
        assert await rvs(client, "b") == b_before
        a_before = await rvs(client, "a")

        # the schema refuses what it can (computeStep 0); what only shared.nodeconfig knows reaches the publisher
        with pytest.raises(kube.ApiError) as refused:
            await k.patch(NODECONFIGS, None, "tenants", {"spec": {"rules": [rule(sharing="mpsShares", computeStep=0)]}})
        assert refused.value.status == 422
        await k.patch(NODECONFIGS, None, "tenants", {"spec": {"rules": [rule(sharing="mpsShares", computeStep=30)]}})
        bad = await wait_for(k, NODECONFIGS, status_is("tenants", 3, Accepted="False"))
        accepted = condition(bad, "Accepted")
        assert accepted["reason"] == INVALID and "spec.rules[0].computeStep" in accepted["message"], accepted
        assert condition(bad, "Applied") == condition(changed, "Applied")  # still generation 2's
        events, _ = await k.list(EVENTS, "default")
        [event] = [
            e
            for e in events
            if e["involvedObject"].get("kind") == "NodeConfig" and e["involvedObject"]["name"] == "tenants"
        ]
        assert (event["type"], event["reason"]) == ("Warning", INVALID)
        assert (
            "spec.rules[0].computeStep" in event["message"] and event["involvedObject"]["uid"] == bad["metadata"]["uid"]
        )
        await pub.idle()
        assert await rvs(client, "a") == a_before  # the last good config (4 shares) stays in force
        assert shares(4)((await node_slices(client, "a"))[0]["spec"]["devices"])
        writes = pub.nodeconfigs.status_writes if pub.nodeconfigs else 0

        # deleted: node a is exclusive again
        _, list_rv = await k.list(RESOURCESLICES)
        await k.delete(NODECONFIGS, None, "tenants")
        await wait_for(k, RESOURCESLICES, gpu_slice_of("a", exclusive), rv=list_rv)
        await pub.idle()
        assert await rvs(client, "b") == b_before
        assert pub.nodeconfigs is not None and pub.nodeconfigs.status_writes == writes  # no status write loop
        assert pub.nodeconfigs.events == 1


async def test_objects_there_at_start_decide_the_first_slices_and_combine_in_name_order(
    bus, api, nats_server, tmp_path
):
    client = api.client_raw
    k = Kube(client)
    await _node(client, "a", {"pool": "a"})
    # same specificity: the rule of the object whose name sorts first wins ("a-first" over "b-second")
    await k.create(NODECONFIGS, None, nodeconfig(rule(sharing="shares", maxShares=2), name="b-second"))
    await k.create(NODECONFIGS, None, nodeconfig(rule(sharing="shares", maxShares=3), name="a-first"))
    async with (
        running_publisher(nats_server.url, str(api.kubeconfig_path)) as pub,
        running_discovery(bus, node="a", simulate="h100x2", root=tmp_path / "a"),
    ):
        await until(pub, lambda: _has(client, "a"))
        await pub.idle()
        assert shares(3)((await node_slices(client, "a"))[0]["spec"]["devices"])
        assert pub.stats.updates == 0  # written once, with the objects' config: no exclusive slices first
        assert [r.name for r in pub.node_config.spec.rules] == ["a-first/tenants", "b-second/tenants"]
        for name in ("a-first", "b-second"):
            await wait_for(k, NODECONFIGS, status_is(name, 1, Accepted="True", Applied="True"))


async def _has(client: Any, node: str) -> bool:
    return len(await node_slices(client, node)) == 1


async def test_a_node_config_file_excludes_the_objects(bus, api, nats_server):
    path = Path(__file__).resolve().parents[2] / "examples" / "node-config" / "shares.yaml"
    async with running_publisher(nats_server.url, str(api.kubeconfig_path), node_config=str(path)) as pub:
        assert pub.nodeconfigs is None and pub.node_config.spec.rules
