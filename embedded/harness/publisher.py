"""In-process publisher for tests and benchmarks: `async with running_publisher(nats_url, kubeconfig) as pub`.

Owns nothing the service does not: it builds a config with fast heartbeats, its own NATS
connection and API client, and offers `until(pub, check)`, which re-checks a condition after each
node sync instead of polling on a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from services.publisher.config import PublisherConfig, check
from services.publisher.service import Publisher
from shared.bus import Bus
from shared.kube import rest as kube
from shared.kube.client import kube_api_client

_replicas = itertools.count(1)


@contextlib.asynccontextmanager
async def running_publisher(
    nats_url: str, kubeconfig: str, *, clean_stop: bool = True, **settings: Any
) -> AsyncIterator[Publisher]:
    """A started publisher replica; settings override PublisherConfig fields (e.g. mig_mode="dynamic")."""
    settings.setdefault("replica_id", f"test-replica-{next(_replicas)}")
    settings.setdefault("heartbeat_seconds", 0.1)
    settings.setdefault("lease_seconds", 0.6)
    settings.setdefault("resync_seconds", 3600.0)
    settings.setdefault("workers", 8)
    cfg = PublisherConfig(nats_url=nats_url, kubeconfig=kubeconfig, **settings)
    check(cfg)
    bus = await Bus.connect(nats_url, name=f"publisher-{cfg.replica_id}")
    api = await kube_api_client(kubeconfig)
    publisher = Publisher(cfg, bus, api)
    try:
        await bus.provision()
        await publisher.start()
        yield publisher
    finally:
        await publisher.stop(clean=clean_stop)
        await bus.close()
        await api.close()


async def until(publisher: Publisher, check_fn: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Return when `check_fn()` is true, re-checking after every node sync; TimeoutError otherwise."""
    async with asyncio.timeout(timeout):
        while True:
            synced = publisher.next_sync()
            if await check_fn():
                return
            await synced.wait()


async def ensure_node(api: Any, name: str) -> str:
    """Create the Node `name` if missing; its uid."""
    try:
        raw = await kube.request(
            api, "POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
        )
    except kube.ApiError as exc:
        if exc.status != 409:
            raise
        raw = await kube.request(api, "GET", f"/api/v1/nodes/{name}")
    doc: dict[str, Any] = kube.decode(raw)
    return str(doc["metadata"]["uid"])


async def node_slices(api: Any, node: str, driver: str = "gpu.nvidia.com", version: str = "v1") -> list[dict[str, Any]]:
    """The node's slices of `driver` as the server has them, sorted by name."""
    raw = await kube.request(
        api,
        "GET",
        f"/apis/resource.k8s.io/{version}/resourceslices",
        query=[("fieldSelector", f"spec.driver={driver},spec.nodeName={node}")],
    )
    items: list[dict[str, Any]] = kube.decode(raw)["items"]
    return sorted(items, key=lambda s: s["metadata"]["name"])
