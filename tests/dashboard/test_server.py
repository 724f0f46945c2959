"""The dashboard server against the real parts: the embedded API server (slices, claims, RBAC, TokenReview,
SubjectAccessReview), a real nats-server (claim lifecycle and health events), the aiohttp app over HTTP.

One module fixture starts them all; the tests share it and leave their objects behind in their own names.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from embedded.apiserver.testing import running_apiserver
from services.computedomain import crd
from services.dashboard.auth import KubernetesAuth
from services.dashboard.server import make_app, serve
from services.dashboard.state import COMPUTEDOMAINS, FleetState, discover
from shared.bus import Bus
from shared.events.catalog import CLAIM, HEALTH, TELEMETRY
from shared.events.claims import ClaimLifecycle, PreparedDeviceRef
from shared.events.health import DeviceHealth
from shared.events.telemetry import DeviceSample, NodeTelemetry
from shared.kube.client import kube_api_client
from shared.kube.resources import NODES, PODS, RESOURCECLAIMS, RESOURCESLICES, Kube, Resource
from shared.natsserver import EmbeddedNats
from tests.dashboard.claimevents import claim_use
from tests.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]
SERVICEACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount")
ROLES = Resource("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLEBINDINGS = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", namespaced=False)
H100 = {"productName": {"string": "NVIDIA H100 80GB HBM3"}}


def _gpu(minor: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": f"gpu-{minor}",
        "attributes": {"type": {"string": "gpu"}, "uuid": {"string": f"GPU-{minor}"}, **H100},
        "capacity": {"memory": {"value": "80Gi"}},
        **extra,
    }


def _mig(parent: int, start: int, size: int) -> dict[str, Any]:
    capacity = {f"memorySlice{i}": {"value": "1"} for i in range(start, start + size)}
    return {
        "name": f"gpu-{parent}-mig-1g10gb-19-{start}",
        "attributes": {
            "type": {"string": "mig"},
            "uuid": {"string": f"MIG-{parent}-{start}"},
            "parentUUID": {"string": f"GPU-{parent}"},
            "profile": {"string": "1g.10gb"},
            **H100,
        },
        "capacity": {"memory": {"value": "10Gi"}, **capacity},
    }


def _slice(node: str, devices: list[dict[str, Any]], driver: str = "gpu.nvidia.com") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver.split('.')[0]}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


class Dash:
    def __init__(self, kube: Kube, bus: Bus, url: str, tenant_url: str, http: aiohttp.ClientSession) -> None:
        self.kube, self.bus, self.url, self.tenant_url, self.http = kube, bus, url, tenant_url, http

    async def get(self, path: str, token: str = "", base: str = "") -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.http.get((base or self.url) + path, headers=headers) as resp:
            return resp.status, await resp.json()

    async def claim(self, namespace: str, name: str, node: str, device: str, config: list[Any] | None = None) -> float:
        """A claim allocated to `device` and reserved for pod `<name>-pod`, as the scheduler writes it; when
        (monotonic) the allocation was written."""
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        }
        created = await self.kube.create(RESOURCECLAIMS, namespace, body)
        allocation: dict[str, Any] = {
            "devices": {
                "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": node, "device": device}],
                "config": config or [],
            }
        }
        status = {
            "allocation": allocation,
            "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": f"uid-{name}"}],
        }
        written = time.monotonic()
        await self.kube.replace(RESOURCECLAIMS, {**created, "status": status}, subresource="status")
        return written


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dash(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Dash]:
    tmp: Path = tmp_path_factory.mktemp("dash")
    nats = EmbeddedNats(store_dir=tmp / "nats")
    await nats.start()
    async with running_apiserver(tmp) as server:
        api = await kube_api_client(str(server.kubeconfig_path))
        kube = Kube(api)
        for ns in ("team-a", "team-b"):
            await kube.create(NAMESPACES, None, {"metadata": {"name": ns}})
        await kube.create(
            NODES,
            None,
            {"metadata": {"name": "node-a"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
        )
        await kube.create(RESOURCESLICES, None, _slice("node-a", [_gpu(0), _gpu(1)]))
        await kube.create(RESOURCESLICES, None, _slice("node-b", [_mig(0, 0, 1), _mig(0, 4, 2), _gpu(1)]))
        for definition in crd.crds():  # ComputeDomains are served: the dashboard watches them
            await kube.create(CRDS, None, definition)
        bus = await Bus.connect(nats.url, name="dashboard-test")
        await bus.provision()
        state = FleetState(kube, **await discover(kube))
        await state.subscribe_bus(bus)
        stopping, synced = asyncio.Event(), asyncio.Event()
        watching = asyncio.create_task(state.run(stopping, synced))
        await asyncio.wait_for(synced.wait(), 20)
        tenant_app = make_app(state, auth=KubernetesAuth(api))
        try:
            async with (
                serve(make_app(state, trace_url_template="http://ui/trace/{traceId}", ping_s=0.5), "127.0.0.1:0") as (
                    host,
                    port,
                ),
                serve(tenant_app, "127.0.0.1:0") as (thost, tport),
                aiohttp.ClientSession() as http,
            ):
                yield Dash(kube, bus, f"http://{host}:{port}", f"http://{thost}:{tport}", http)
        finally:
            stopping.set()
            await watching
            await bus.close()
            await api.close()
            await nats.close()


async def _next_event(content: aiohttp.StreamReader, telemetry: bool = False) -> tuple[str, Any]:
    """The next SSE event (name, data); comments (pings) are skipped, and `telemetry` events unless asked for."""
    name, data = "", ""
    while True:
        line = (await content.readline()).decode()
        if line in ("\n", ""):
            if data and (telemetry or name != "telemetry"):
                return name, json.loads(data)
            if line == "":
                raise EOFError("the stream ended")
            name, data = "", ""
            continue
        if line.startswith("event: "):
            name = line[7:].strip()
        elif line.startswith("data: "):
            data += line[6:].strip()


until = functools.partial(eventually, timeout=5.0, every=0.05)  # state the API does not push


def _device(fleet: dict[str, Any], node: str, device: str) -> dict[str, Any]:
    row = next(n for n in fleet["nodes"] if n["name"] == node)
    return next(d for d in row["devices"] if d["name"] == device)


async def test_fleet_shows_nodes_and_gpus_from_the_slices(dash: Dash) -> None:
    status, fleet = await dash.get("/api/fleet")
    assert status == 200
    assert [n["name"] for n in fleet["nodes"]] == ["node-a", "node-b"]
    a0 = _device(fleet, "node-a", "gpu-0")
    assert (a0["product"], a0["memoryBytes"], a0["type"], a0["uuid"]) == (
        "NVIDIA H100 80GB HBM3",
        80 << 30,
        "gpu",
        "GPU-0",
    )
    node_a = next(n for n in fleet["nodes"] if n["name"] == "node-a")
    assert node_a["ready"] is True and fleet["traceUrlTemplate"] == "http://ui/trace/{traceId}"
    # static MIG: the parent GPU is drawn for its MIG devices, placed by their memory slices
    names = [d["name"] for d in next(n for n in fleet["nodes"] if n["name"] == "node-b")["devices"]]
    assert names == ["gpu-0", "gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-4", "gpu-1"]
    parent, mig = _device(fleet, "node-b", "gpu-0"), _device(fleet, "node-b", "gpu-0-mig-1g10gb-19-4")
    assert parent["migSlots"] == 8 and mig["parent"] == "gpu-0"
    assert mig["mig"] == {"profile": "1g.10gb", "start": 4, "size": 2} and mig["type"] == "mig"
    assert fleet["groups"] == [{"name": "ungrouped", "nodes": ["node-a", "node-b"]}]
    assert fleet["counters"]["NVIDIA H100 80GB HBM3"]["free"] == 5


async def test_a_claim_allocated_shows_on_its_device_within_a_second(dash: Dash) -> None:
    sharing = [
        {
            "source": "FromClaim",
            "requests": ["gpu"],
            "opaque": {
                "driver": "gpu.nvidia.com",
                "parameters": {
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "GpuConfig",
                    "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}},
                },
            },
        }
    ]
    async with dash.http.get(dash.url + "/api/stream") as stream:
        name, first = await _next_event(stream.content)
        assert name == "fleet" and first["full"] is True
        written = await dash.claim("team-a", "train", "node-a", "gpu-1", sharing)
        while True:
            name, delta = await asyncio.wait_for(_next_event(stream.content), 5)
            rows = {n["name"]: n for n in delta["nodes"]}
            device = next((d for d in rows.get("node-a", {}).get("devices", []) if d["name"] == "gpu-1"), None)
            if device and device["allocations"]:
                break
        took = time.monotonic() - written
    assert name == "delta" and delta["version"] > first["version"]
    assert took < 1.0, f"the delta came {took:.2f} s after the allocation was written"
    assert device["state"] == "claimed"
    alloc = device["allocations"][0]
    assert (alloc["namespace"], alloc["claim"], alloc["pods"]) == ("team-a", "train", ["team-a/train-pod"])
    assert alloc["sharing"]["mode"] == "mps" and alloc["sharing"]["threadPercentage"] == 50
    status, claim = await dash.get("/api/claim/team-a/train")
    assert status == 200 and claim["claim"]["devices"] == [{"node": "node-a", "device": "gpu-1"}]


async def test_an_xid_shows_a_tainted_gpu_and_its_history(dash: Dash) -> None:
    health = DeviceHealth(
        node="node-a",
        device="gpu-0",
        uuid="GPU-0",
        state="Unhealthy",
        reason="xid",
        xid=79,
        message="GPU has fallen off the bus",
        observed_at=time.time(),
    )
    await dash.bus.publish(HEALTH, health, node="node-a", device="gpu-0")
    prepared = ClaimLifecycle(
        event="prepared",
        node="node-a",
        driver="gpu.nvidia.com",
        claim_uid="u1",
        claim_namespace="team-b",
        claim_name="infer",
        devices=[PreparedDeviceRef(request="gpu", pool="node-a", device="gpu-0")],
    )
    await dash.bus.publish(CLAIM, prepared, namespace="team-b", node="node-a", event="prepared")

    async def both_seen() -> Any:  # the bus delivers in its own time; the row follows within flush_s
        status, body = await dash.get("/api/device/node-a/gpu-0")
        return body if status == 200 and len(body["events"]) >= 2 and body["device"]["state"] != "free" else None

    body = await until(both_seen, "the health and claim events on node-a/gpu-0")
    assert body["device"]["state"] == "tainted" and body["device"]["xid"] == 79
    assert [e["type"] for e in body["events"]] == ["prepared", "health"]  # newest first
    assert "XID 79" in body["events"][1]["summary"]


async def test_a_tenant_sees_only_granted_namespaces(dash: Dash) -> None:
    await dash.claim("team-b", "secret-job", "node-b", "gpu-1")
    await dash.kube.create(SERVICEACCOUNTS, "team-a", {"metadata": {"name": "viewer", "namespace": "team-a"}})
    await dash.kube.create(
        ROLES,
        "team-a",
        {
            "metadata": {"name": "claims", "namespace": "team-a"},
            "rules": [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["list", "get"]}],
        },
    )
    await dash.kube.create(
        ROLEBINDINGS,
        "team-a",
        {
            "metadata": {"name": "viewer", "namespace": "team-a"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "claims"},
            "subjects": [{"kind": "ServiceAccount", "name": "viewer", "namespace": "team-a"}],
        },
    )
    issued = await dash.kube.create_subresource(
        SERVICEACCOUNTS, "team-a", "viewer", "token", {"spec": {"expirationSeconds": 3600}}
    )
    token = issued["status"]["token"]

    async def allocated() -> Any:
        status, fleet = await dash.get("/api/fleet", token, dash.tenant_url)
        assert status == 200, fleet
        return fleet if _device(fleet, "node-b", "gpu-1")["allocations"] else None

    fleet = await until(allocated, "team-b's claim on node-b/gpu-1")
    other = _device(fleet, "node-b", "gpu-1")
    assert fleet["namespaces"] == ["team-a"]
    assert other["state"] == "claimed"
    assert other["allocations"] == [
        {**other["allocations"][0], "namespace": "", "claim": "", "pods": [], "otherTenant": True}
    ]
    assert "secret-job" not in json.dumps(fleet)
    assert _device(fleet, "node-a", "gpu-1")["allocations"][0]["claim"] == "train"
    status, body = await dash.get("/api/claim/team-b/secret-job", token, dash.tenant_url)
    assert status == 403 and "team-b" in body["error"]
    status, body = await dash.get("/api/fleet?namespace=team-b", token, dash.tenant_url)
    assert status == 403
    status, body = await dash.get("/api/fleet", "not-a-token", dash.tenant_url)
    assert status == 401 and "token" in body["error"]
    status, body = await dash.get("/api/fleet", "", dash.tenant_url)
    assert status == 401


async def test_a_compute_domain_groups_its_nodes(dash: Dash) -> None:
    body = {
        "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
        "kind": crd.KIND,
        "metadata": {"name": "dom", "namespace": "team-a"},
        "spec": {"channel": {"resourceClaimTemplate": {"name": "dom-channel"}}},
    }
    created = await dash.kube.create(COMPUTEDOMAINS, "team-a", body)
    status = {
        "status": "Ready",
        "nodes": [{"name": "node-b", "cliqueID": "c.1", "ipAddress": "10.0.0.2", "status": "Ready"}],
    }
    await dash.kube.replace(COMPUTEDOMAINS, {**created, "status": status}, subresource="status")

    async def grouped() -> Any:
        _, fleet = await dash.get("/api/fleet")
        return fleet if len(fleet["groups"]) == 2 else None

    fleet = await until(grouped, "the domain's group")
    assert fleet["groups"] == [
        {"name": "domain team-a/dom", "nodes": ["node-b"]},
        {"name": "ungrouped", "nodes": ["node-a"]},
    ]
    assert [n["name"] for n in fleet["nodes"]] == ["node-b", "node-a"]  # rows in group order
    assert next(n for n in fleet["nodes"] if n["name"] == "node-b")["domains"] == ["team-a/dom"]


async def test_unknown_node_device_and_path_are_json_404s(dash: Dash) -> None:
    status, body = await dash.get("/api/device/no-such-node/gpu-0")
    assert status == 404 and "no-such-node" in body["error"]
    status, body = await dash.get("/api/device/node-a/gpu-9")
    assert status == 404 and "gpu-0" in body["error"]
    status, body = await dash.get("/api/nothing")
    assert status == 404 and "error" in body


async def test_explain_asks_the_api_whether_the_pod_exists(dash: Dash) -> None:
    status, body = await dash.get("/api/pod/team-a/no-such-pod/explain")
    assert status == 404 and "no pod team-a/no-such-pod" in body["error"]
    await dash.kube.create(
        PODS, "team-a", {"metadata": {"name": "explained"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    )
    status, body = await dash.get("/api/pod/team-a/explained/explain")
    assert status == 501 and "explain needs the local-cluster tools" in body["error"]  # this app has no explainer


def _sample(node: str, at: float, sm: int) -> NodeTelemetry:
    return NodeTelemetry(
        node=node,
        interval_s=10.0,
        observed_at=at,
        devices=[
            DeviceSample(
                device=f"gpu-{i}",
                uuid=f"GPU-{i}",
                sm_percent=sm + i,
                memory_used_bytes=(sm + i) << 28,
                memory_total_bytes=80 << 30,
                power_mw=100_000 + 1000 * sm,
                temperature_c=30 + sm // 4,
            )
            for i in range(2)
        ],
    )


async def test_utilisation_rings_come_from_telemetry_in_the_api_and_the_stream(dash: Dash) -> None:
    now = time.time()
    for k, sm in enumerate((10, 50, 90)):  # three 10 s slots
        await dash.bus.publish(TELEMETRY, _sample("node-a", now - 20 + 10 * k, sm), node="node-a")

    async def three_points() -> Any:
        status, body = await dash.get("/api/telemetry/node-a")
        return body if status == 200 and len(body["devices"]["gpu-0"]["ring"]["t"]) == 3 else None

    body = await until(three_points, "node-a's three samples")
    gpu0 = body["devices"]["gpu-0"]
    assert body["intervalS"] == 10.0 and body["windowS"] == 600.0
    assert (gpu0["smPercent"], gpu0["memoryUsedBytes"], gpu0["memoryTotalBytes"]) == (90, 90 << 28, 80 << 30)
    assert (gpu0["powerW"], gpu0["temperatureC"]) == (190, 52)
    assert gpu0["ring"]["smPercent"] == [10, 50, 90] and gpu0["ring"]["powerW"] == [110, 150, 190]
    status, missing = await dash.get("/api/telemetry/node-z")
    assert status == 404 and "--telemetry-interval" in missing["error"]
    async with dash.http.get(dash.url + "/api/stream") as stream:
        name, _ = await _next_event(stream.content, telemetry=True)
        assert name == "fleet"
        name, tiles = await asyncio.wait_for(_next_event(stream.content, telemetry=True), 5)
        assert name == "telemetry" and tiles["full"] is True
        assert tiles["nodes"]["node-a"]["gpu-1"] == [pytest.approx(now), 91, 91 << 28, 80 << 30, 190, 52, [11, 51, 91]]
        await dash.bus.publish(TELEMETRY, _sample("node-a", now + 10, 20), node="node-a")
        while True:
            name, tiles = await asyncio.wait_for(_next_event(stream.content, telemetry=True), 5)
            if name == "telemetry":
                break
        assert tiles["full"] is False and list(tiles["nodes"]) == ["node-a"]
        assert tiles["nodes"]["node-a"]["gpu-0"][1:] == [20, 20 << 28, 80 << 30, 120, 35], "newest figures, no ring"


async def test_gpu_hours_of_the_last_day_per_namespace(dash: Dash) -> None:
    now = time.time()
    whole = [PreparedDeviceRef(request="gpu", pool="node-a", device="gpu-1", uuid="GPU-1")]
    share = [
        PreparedDeviceRef(
            request="gpu",
            pool="node-a",
            device="gpu-0",
            share_id="s1",
            consumed_capacity={"memory": "10Gi"},
            capacity={"memory": "80Gi"},
        )
    ]
    mig = [PreparedDeviceRef(request="mig", pool="node-b", device="gpu-0-mig-1g10gb-19-0")]
    events = [
        claim_use("prepared", "h-whole", now - 7200, whole, node="node-a"),  # 1 h whole GPU
        claim_use("unprepared", "h-whole", now - 3600, whole, node="node-a"),
        claim_use("prepared", "h-share", now - 7200, share, node="node-a"),  # 2 h of 1/8 GPU: 0.25
        claim_use("rolled-back", "h-share", now, share, node="node-a"),
        claim_use("prepared", "h-mig", now - 3600, mig, node="node-a"),  # open for 1 h of a MIG device
        claim_use("prepared", "h-old", now - 30 * 3600, whole, node="node-a"),  # ended 25 h ago: outside the day
        claim_use("unprepared", "h-old", now - 25 * 3600, whole, node="node-a"),
        claim_use("prepared", "h-other", now - 3600, whole, ns="team-b", node="node-a"),
    ]
    for event in events:
        await dash.bus.publish(CLAIM, event, namespace=event.claim_namespace, node="node-a", event=event.event)

    async def counted() -> Any:
        status, body = await dash.get("/api/gpu-hours?namespace=team-a")
        assert status == 200, body
        rows = body["namespaces"]
        return rows if rows and rows[0]["migHours"] and rows[0]["gpuHours"] >= 1.2 else None

    rows = await until(counted, "team-a's GPU-hours")
    assert [r["namespace"] for r in rows] == ["team-a"], "another namespace is not shown to a team-a viewer"
    assert rows[0]["gpuHours"] == pytest.approx(1.25, abs=0.01)
    assert rows[0]["migHours"]["1g10gb"] == pytest.approx(1.0, abs=0.01)
    assert rows[0]["claimsOpen"] == 1
    _, everyone = await dash.get("/api/gpu-hours")
    assert everyone["windowS"] == 86400.0 and "team-b" in [r["namespace"] for r in everyone["namespaces"]]
