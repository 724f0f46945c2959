"""`gpu_dra_device_allocation_info` from the dashboard's real watches: the embedded API server's slices, claims and
pods, the FleetState's informers, the collector in a registry, scraped as Prometheus text and parsed back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from embedded.apiserver.testing import running_apiserver
from services.dashboard import allocmetrics
from services.dashboard.allocmetrics import AllocationInfo, pod_claims
from services.dashboard.state import FleetState, discover
from shared.kube.client import kube_api_client
from shared.kube.resources import PODS, RESOURCECLAIMS, RESOURCESLICES, Kube, Resource
from tests.polling import eventually

pytestmark = [pytest.mark.timeout(60)]
on_the_module_loop = pytest.mark.asyncio(loop_scope="module")
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
Series = set[tuple[str, ...]]


def test_containers_are_those_naming_a_reference_that_resolves_to_the_claim() -> None:
    pod = {
        "metadata": {"name": "p"},
        "spec": {
            "resourceClaims": [
                {"name": "direct", "resourceClaimName": "shared-gpu"},
                {"name": "tpl", "resourceClaimTemplateName": "one-gpu"},
                {"name": "unresolved", "resourceClaimTemplateName": "one-gpu"},
            ],
            "initContainers": [{"name": "warm", "resources": {"claims": [{"name": "tpl"}]}}],
            "containers": [
                {"name": "a", "resources": {"claims": [{"name": "direct"}, {"name": "tpl"}]}},
                {"name": "b", "resources": {"claims": [{"name": "unresolved"}]}},
                {"name": "c"},
            ],
        },
        "status": {
            "resourceClaimStatuses": [{"name": "tpl", "resourceClaimName": "p-tpl-x1"}],
            "extendedResourceClaimStatus": {
                "resourceClaimName": "p-extended-gpus-y2",
                "requestMappings": [
                    {"containerName": "c", "resourceName": "nvidia.com/gpu", "requestName": "container-2"}
                ],
            },
        },
    }
    assert pod_claims(pod).containers == {"shared-gpu": ("a",), "p-tpl-x1": ("warm", "a"), "p-extended-gpus-y2": ("c",)}


class World:
    def __init__(self, kube: Kube, registry: CollectorRegistry, info: AllocationInfo) -> None:
        self.kube, self.registry, self.info = kube, registry, info

    def series(self) -> Series:
        text = generate_latest(self.registry).decode()
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == allocmetrics.NAME]
        assert all(s.value == 1.0 for s in family.samples)
        return {tuple(s.labels[k] for k in allocmetrics.LABELS) for s in family.samples}

    async def series_become(self, wanted: Series) -> None:
        await eventually(lambda: self.series() == wanted, f"the series {wanted}", timeout=10)

    async def pod(self, name: str, claim: str, containers: dict[str, bool]) -> dict[str, Any]:
        """A pod whose containers named True use `claim` (through a template reference resolved in its status)."""
        body = {
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "one-gpu"}],
                "containers": [
                    {"name": c, "image": "ubuntu", **({"resources": {"claims": [{"name": "gpus"}]}} if uses else {})}
                    for c, uses in containers.items()
                ],
            },
        }
        pod = await self.kube.create(PODS, "team-a", body)
        pod["status"] = {"resourceClaimStatuses": [{"name": "gpus", "resourceClaimName": claim}]}
        return await self.kube.replace(PODS, pod, subresource="status")

    async def claim(self, name: str, device: str, pods: list[dict[str, Any]]) -> dict[str, Any]:
        body = {
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        }
        created = await self.kube.create(RESOURCECLAIMS, "team-a", body)
        created["status"] = {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": device}]
                }
            },
            "reservedFor": [
                {"resource": "pods", "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]} for p in pods
            ],
        }
        return await self.kube.replace(RESOURCECLAIMS, created, subresource="status")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    tmp: Path = tmp_path_factory.mktemp("allocmetrics")
    async with running_apiserver(tmp) as server:
        api = await kube_api_client(str(server.kubeconfig_path))
        kube = Kube(api)
        await kube.create(NAMESPACES, None, {"metadata": {"name": "team-a"}})
        devices = [
            {"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": f"GPU-{i}"}}}
            for i in range(3)
        ]
        await kube.create(
            RESOURCESLICES,
            None,
            {
                "metadata": {"name": "node-a-gpu"},
                "spec": {
                    "driver": "gpu.nvidia.com",
                    "nodeName": "node-a",
                    "devices": devices,
                    "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                },
            },
        )
        state = FleetState(kube, **await discover(kube))
        registry = CollectorRegistry()
        stopping, synced = asyncio.Event(), asyncio.Event()
        async with allocmetrics.exported(state, registry) as info:
            watching = asyncio.create_task(state.run(stopping, synced))
            try:
                await asyncio.wait_for(synced.wait(), 20)
                yield World(kube, registry, info)
            finally:
                stopping.set()
                await watching
        await api.close()


@on_the_module_loop
async def test_a_reserved_pod_maps_its_gpu_to_the_containers_using_the_claim(world: World) -> None:
    pod = await world.pod("trainer", "trainer-gpus-abc", {"main": True, "logger": False})
    await world.claim("trainer-gpus-abc", "gpu-1", [pod])
    await world.series_become({("GPU-1", "node-a", "team-a", "trainer", "main", "trainer-gpus-abc")})
    assert list(world.info.pods) == [pod["metadata"]["uid"]]

    # released: the series goes, and so does the pod read for it
    claim = await world.kube.get(RESOURCECLAIMS, "team-a", "trainer-gpus-abc")
    claim["status"].pop("reservedFor")
    await world.kube.replace(RESOURCECLAIMS, claim, subresource="status")
    await world.series_become(set())
    assert world.info.pods == {}
    await world.kube.delete(RESOURCECLAIMS, "team-a", "trainer-gpus-abc")


@on_the_module_loop
async def test_a_shared_claim_gives_a_series_per_pod_and_a_vanished_pod_none(world: World) -> None:
    first = await world.pod("worker-0", "shared", {"w": True})
    second = await world.pod("worker-1", "shared", {"w": True, "w2": True})
    gone = {"metadata": {"name": "worker-gone", "uid": "no-such-uid"}}
    await world.claim("shared", "gpu-2", [first, second, gone])
    await world.series_become(
        {
            ("GPU-2", "node-a", "team-a", "worker-0", "w", "shared"),
            ("GPU-2", "node-a", "team-a", "worker-1", "w", "shared"),
            ("GPU-2", "node-a", "team-a", "worker-1", "w2", "shared"),
        }
    )
    await world.kube.delete(RESOURCECLAIMS, "team-a", "shared")
    await world.series_become(set())
    assert world.info.pods == {}
