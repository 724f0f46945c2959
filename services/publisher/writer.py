"""Writing one node's pools: what exists vs what is desired, by content hash; create, update, delete.

Owns the slice cache (`SliceStore`, filled by LIST and by every write's answer), the no-op test
(same names, same hashes, one generation: nothing is written), the generation bump (every change
rewrites every slice of the pool at generation+1, so the pool is never mixed), and the error
handling: 409 (stale resourceVersion, or a create that already happened) and 404 re-read the pool
from the server and try again; 422 is reported with the server's message and not retried.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from opentelemetry.trace import SpanKind
from prometheus_client import Histogram

from services.publisher import objects
from services.publisher.apiversion import ServerProfile
from services.publisher.slices import DRIVERS, DesiredPool
from shared.backoff import Backoff
from shared.kube import rest as kube
from shared.logs import get_logger
from shared.numbers import decimal_int
from shared.telemetry import get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)

WRITE_SECONDS = Histogram(
    "gpu_dra_publisher_slice_write_seconds",
    "One ResourceSlice write to the API server (its request, failed ones included)",
    ["verb"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
MAX_ATTEMPTS = 6


class OwnerRef(msgspec.Struct):
    name: str = ""
    uid: str = ""
    kind: str = ""


class Meta(msgspec.Struct):
    name: str
    uid: str = ""
    resourceVersion: str = ""  # noqa: N815 - wire name
    annotations: dict[str, str] = msgspec.field(default_factory=dict)
    ownerReferences: list[OwnerRef] = msgspec.field(default_factory=list)  # noqa: N815
    deletionTimestamp: str | None = None  # noqa: N815


class PoolRef(msgspec.Struct):
    name: str = ""
    generation: int = 0
    resourceSliceCount: int = 0  # noqa: N815


class BasicView(msgspec.Struct):
    taints: list[Any] = msgspec.field(default_factory=list)


class DeviceView(msgspec.Struct):
    name: str
    taints: list[Any] = msgspec.field(default_factory=list)
    basic: BasicView | None = None

    @property
    def has_taints(self) -> bool:
        return bool(self.taints or (self.basic is not None and self.basic.taints))


class SpecView(msgspec.Struct):
    driver: str = ""
    nodeName: str | None = None  # noqa: N815
    pool: PoolRef = msgspec.field(default_factory=PoolRef)
    devices: list[DeviceView] = msgspec.field(default_factory=list)


class SliceView(msgspec.Struct):
    """The parts of a stored ResourceSlice the writer looks at."""

    metadata: Meta
    spec: SpecView = msgspec.field(default_factory=SpecView)

    @property
    def content_hash(self) -> str:
        return self.metadata.annotations.get(objects.HASH_ANNOTATION, "")


SliceList = kube.Page[SliceView]
_SLICE = msgspec.json.Decoder(SliceView)
_LIST = msgspec.json.Decoder(SliceList)


def _rv(value: str) -> int:
    number = decimal_int(value)
    return -1 if number is None else number


class SliceStore:
    """The slices of our drivers, by (driver, node) then name. Newer resourceVersions win."""

    def __init__(self) -> None:
        self.pools: dict[tuple[str, str], dict[str, SliceView]] = {}

    def pool(self, driver: str, node: str) -> dict[str, SliceView]:
        return self.pools.get((driver, node), {})

    def put(self, view: SliceView) -> None:
        key = (view.spec.driver, view.spec.nodeName or "")
        bucket = self.pools.setdefault(key, {})
        old = bucket.get(view.metadata.name)
        if old is not None and _rv(old.metadata.resourceVersion) > _rv(view.metadata.resourceVersion) >= 0:
            return
        bucket[view.metadata.name] = view

    def remove(self, driver: str, node: str, name: str) -> None:
        bucket = self.pools.get((driver, node))
        if bucket is not None:
            bucket.pop(name, None)
            if not bucket:
                self.pools.pop((driver, node), None)

    def replace_pool(self, driver: str, node: str, views: list[SliceView]) -> None:
        self.pools.pop((driver, node), None)
        for view in views:
            self.put(view)

    def replace_driver(self, driver: str, listed: SliceList) -> None:
        """A full LIST for one driver: entries written after the list began survive it."""
        list_rv = _rv(listed.metadata.resourceVersion)
        fresh: dict[tuple[str, str], dict[str, SliceView]] = {}
        for view in listed.items:
            fresh.setdefault((driver, view.spec.nodeName or ""), {})[view.metadata.name] = view
        for key, bucket in list(self.pools.items()):
            if key[0] != driver:
                continue
            for name, view in bucket.items():
                if _rv(view.metadata.resourceVersion) > list_rv >= 0:
                    fresh.setdefault(key, {})[name] = view
            self.pools.pop(key)
        for key, bucket in fresh.items():
            self.pools[key] = bucket

    def nodes(self) -> set[str]:
        return {node for (_, node) in self.pools}

    def forget(self, nodes: list[str]) -> None:
        """Nodes another replica now writes: their cached slices go (re-read if they come back)."""
        gone = set(nodes)
        for key in [key for key in self.pools if key[1] in gone]:
            self.pools.pop(key, None)


class WriteStats(msgspec.Struct, kw_only=True):
    creates: int = 0
    updates: int = 0
    deletes: int = 0
    conflicts: int = 0
    invalid: int = 0

    @property
    def writes(self) -> int:
        return self.creates + self.updates + self.deletes


class Retry(Exception):
    """The cached pool was stale; re-read it and compute the writes again."""


class InvalidSlice(RuntimeError):
    """The server rejected a slice as invalid (422); retrying cannot help."""


class SliceWriter:
    """Brings (driver, node) pools on the server to what is desired, writing only what differs."""

    def __init__(self, api_client: Any, profile: ServerProfile, store: SliceStore | None = None) -> None:
        self.api = api_client
        self.profile = profile
        self.store = store or SliceStore()
        self.stats = WriteStats()
        self._warned_dropped = False

    @property
    def collection(self) -> str:
        return f"/apis/{self.profile.group_version}/resourceslices"

    async def list_driver(self, driver: str) -> None:
        """Fill the cache with every slice of `driver` (one LIST, paged)."""
        items: list[SliceView] = []
        rv = ""
        async for page in kube.list_pages(
            self.api, self.collection, SliceView, query=[("fieldSelector", f"spec.driver={driver}")]
        ):
            items += page.items
            rv = rv or page.metadata.resourceVersion
        self.store.replace_driver(driver, SliceList(metadata=kube.ListMeta(resourceVersion=rv), items=items))

    async def refresh(self, driver: str, node: str) -> None:
        raw = await kube.request(
            self.api, "GET", self.collection, query=[("fieldSelector", f"spec.driver={driver},spec.nodeName={node}")]
        )
        self.store.replace_pool(driver, node, _LIST.decode(raw).items)

    async def refresh_node(self, node: str) -> None:
        """Re-read every pool of `node` (all drivers: one GET)."""
        raw = await kube.request(self.api, "GET", self.collection, query=[("fieldSelector", f"spec.nodeName={node}")])
        views = _LIST.decode(raw).items
        for driver in DRIVERS:
            self.store.replace_pool(driver, node, [v for v in views if v.spec.driver == driver])

    async def sync(self, driver: str, node: str, pool: DesiredPool | None, node_uid: str = "") -> WriteStats:
        """Make the server's pool match `pool` (None: delete the pool). The writes it took."""
        done = WriteStats()
        backoff = Backoff(initial_s=0.05, cap_s=1.0)
        for attempt in range(MAX_ATTEMPTS):
            try:
                await self._sync_once(driver, node, pool, node_uid, done)
                return done
            except Retry as exc:
                done.conflicts += 1
                self.stats.conflicts += 1
                log.info(
                    "slice write conflict; re-reading the pool",
                    driver=driver,
                    node=node,
                    attempt=attempt + 1,
                    reason=str(exc),
                )
                await asyncio.sleep(backoff.next())
                await self.refresh(driver, node)
        raise RuntimeError(f"pool {driver}/{node} still conflicting after {MAX_ATTEMPTS} attempts")

    async def _sync_once(
        self, driver: str, node: str, pool: DesiredPool | None, node_uid: str, done: WriteStats
    ) -> None:
        existing = {n: v for n, v in self.store.pool(driver, node).items() if v.metadata.deletionTimestamp is None}
        desired = objects.render(pool, node_uid) if pool is not None else []
        wanted = {r.name: r for r in desired}
        generation = max((v.spec.pool.generation for v in existing.values()), default=0)
        if set(existing) == set(wanted) and all(
            existing[n].content_hash == r.content_hash and existing[n].spec.pool.generation == generation
            for n, r in wanted.items()
        ):
            return
        generation += 1
        for name in sorted(set(existing) - set(wanted)):
            await self._delete(existing[name], done)
        for name, rendered in wanted.items():
            old = existing.get(name)
            if old is None:
                await self._create(rendered, generation, done)
            else:
                await self._update(rendered, generation, old, done)

    async def _delete(self, view: SliceView, done: WriteStats) -> None:
        name = view.metadata.name
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "preconditions": {"uid": view.metadata.uid, "resourceVersion": view.metadata.resourceVersion},
        }
        with tracer.start_as_current_span("DELETE resourceslice", kind=SpanKind.CLIENT) as span:
            span.set_attribute("k8s.resourceslice.name", name)
            try:
                with WRITE_SECONDS.labels("delete").time():
                    await kube.request(self.api, "DELETE", f"{self.collection}/{name}", body=body)
            except kube.ApiError as exc:
                if exc.status == 404:
                    pass
                elif exc.status == 409:
                    raise Retry(f"delete {name}: {exc.message}") from exc
                else:
                    raise
        self.store.remove(view.spec.driver, view.spec.nodeName or "", name)
        done.deletes += 1
        self.stats.deletes += 1

    async def _create(self, rendered: objects.RenderedSlice, generation: int, done: WriteStats) -> None:
        body = rendered.body(generation, self.profile)
        with tracer.start_as_current_span("POST resourceslice", kind=SpanKind.CLIENT) as span:
            span.set_attribute("k8s.resourceslice.name", rendered.name)
            span.set_attribute("k8s.resourceslice.generation", generation)
            try:
                with WRITE_SECONDS.labels("create").time():
                    raw = await kube.request(self.api, "POST", self.collection, body=body)
            except kube.ApiError as exc:
                if exc.status == 409:
                    raise Retry(f"create {rendered.name}: {exc.message}") from exc
                self._check_invalid(exc, rendered)
                raise
        self._stored(raw, rendered)
        done.creates += 1
        self.stats.creates += 1

    async def _update(self, rendered: objects.RenderedSlice, generation: int, old: SliceView, done: WriteStats) -> None:
        body = rendered.body(generation, self.profile, resource_version=old.metadata.resourceVersion)
        with tracer.start_as_current_span("PUT resourceslice", kind=SpanKind.CLIENT) as span:
            span.set_attribute("k8s.resourceslice.name", rendered.name)
            span.set_attribute("k8s.resourceslice.generation", generation)
            try:
                with WRITE_SECONDS.labels("update").time():
                    raw = await kube.request(self.api, "PUT", f"{self.collection}/{rendered.name}", body=body)
            except kube.ApiError as exc:
                if exc.status in (404, 409):
                    raise Retry(f"update {rendered.name}: HTTP {exc.status} {exc.message}") from exc
                self._check_invalid(exc, rendered)
                raise
        self._stored(raw, rendered)
        done.updates += 1
        self.stats.updates += 1

    def _check_invalid(self, exc: kube.ApiError, rendered: objects.RenderedSlice) -> None:
        if exc.status in (400, 422):
            self.stats.invalid += 1
            raise InvalidSlice(
                f"the API server rejected slice {rendered.name} of pool {rendered.driver}/{rendered.node}: "
                f"{exc.message}"
            ) from exc

    def _stored(self, raw: bytes, rendered: objects.RenderedSlice) -> None:
        view = _SLICE.decode(raw)
        self.store.put(view)
        wanted_taints = any(d.get("taints") for d in rendered.spec.get("devices", []))
        if wanted_taints and not any(d.has_taints for d in view.spec.devices) and not self._warned_dropped:
            self._warned_dropped = True
            log.warning(
                "the API server dropped device taints; enable the DRADeviceTaints feature gate "
                "for unhealthy devices to be avoided",
                slice=rendered.name,
            )
