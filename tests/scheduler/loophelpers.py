"""A small cluster for scheduler-loop tests: API server, classes, Ready nodes with simulated slices, the loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from embedded.apiserver.testing import RunningApiServer, running_apiserver
from embedded.scheduler.loop import Scheduler
from embedded.scheduler.simslices import node_slices, renamed
from shared.deviceclasses import device_classes
from shared.kube.resources import DEVICECLASSES, NODES, PODS, RESOURCECLAIMS, RESOURCESLICES, Kube


class Cluster:
    def __init__(self, api: RunningApiServer, kube: Kube, client: Any) -> None:
        self.api = api
        self.kube = kube
        self.client = client
        self.scheduler: Scheduler | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def start_scheduler(self, **options: Any) -> Scheduler:
        self._stopping = asyncio.Event()
        self.scheduler = Scheduler(self.client, **options)
        self._task = asyncio.create_task(self.scheduler.run(self._stopping))
        await asyncio.wait_for(self.scheduler.ready.wait(), 10)
        return self.scheduler

    async def stop_scheduler(self) -> None:
        if self._task is not None:
            self._stopping.set()
            await asyncio.wait_for(self._task, 10)
            self._task = None

    async def pod(
        self, name: str, claims: list[dict[str, Any]] | None = None, namespace: str = "default", **spec: Any
    ) -> dict[str, Any]:
        container: dict[str, Any] = {"name": "main", "image": "busybox"}
        if claims:
            container["resources"] = {"claims": [{"name": c["name"]} for c in claims]}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            # No kubelet runs here: a grace period of 0 lets a deleted bound pod go at once.
            "spec": {
                "containers": [container],
                "terminationGracePeriodSeconds": 0,
                **({"resourceClaims": claims} if claims else {}),
                **spec,
            },
        }
        return await self.kube.create(PODS, namespace, body)

    async def get_pod(self, name: str, namespace: str = "default") -> dict[str, Any]:
        return await self.kube.get(PODS, namespace, name)

    async def claims(self, namespace: str = "default") -> list[dict[str, Any]]:
        items, _ = await self.kube.list(RESOURCECLAIMS, namespace)
        return items


def ready_node(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": spec,
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test"}]},
    }


async def add_node(kube: Kube, name: str, base_slices: list[dict[str, Any]], base_node: str, **spec: Any) -> None:
    node = await kube.create(NODES, None, ready_node(name, **spec))
    if node.get("status", {}).get("conditions") is None:
        node["status"] = ready_node(name)["status"]
        await kube.replace(NODES, node, subresource="status")
    for s in renamed(base_slices, base_node, name):
        s["metadata"].pop("ownerReferences", None)
        await kube.create(RESOURCESLICES, None, s)


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, inventory: Any, nodes: int = 2, start: bool = True) -> AsyncIterator[Cluster]:
    async with running_apiserver(tmp_path) as api, api.client() as client:
        kube = Kube(client)
        for cls in device_classes("v1"):
            await kube.create(DEVICECLASSES, None, cls)
        base = node_slices(inventory)
        for i in range(nodes):
            await add_node(kube, f"node-{i}", base, inventory.node)
        c = Cluster(api, kube, client)
        if start:
            await c.start_scheduler()
        try:
            yield c
        finally:
            await c.stop_scheduler()


def devices_of(claim: dict[str, Any]) -> list[tuple[str, str, str]]:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return [(r["driver"], r["pool"], r["device"]) for r in results]


def condition(pod: dict[str, Any], kind: str = "PodScheduled") -> dict[str, Any] | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)
