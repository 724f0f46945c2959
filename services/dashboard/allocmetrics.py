"""`gpu_dra_device_allocation_info{UUID,Hostname,namespace,pod,container,claim} 1`: which container of which pod
holds which device, labelled as DCGM-exporter's pod mapping is, so chargeback and utilisation dashboards join it
with DCGM's series and with discovery's `gpu_dra_device_healthy` on `UUID`.

Computed here because the dashboard already watches every claim and slice: a claim's allocation names its devices
and `status.reservedFor` its pods; the slices give each device's `uuid` attribute and node. Which containers use a
claim is only in the pod, and the dashboard has no pod watch: each reserved pod is read once (`get`, the RBAC the
dashboard has) and cached by uid (a pod's claim references and containers never change), and forgotten when no
claim reserves it. The series are built when scraped (prometheus_client's custom-collector API), from copies of
the caches taken on the endpoint's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

import msgspec
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.dashboard import model
from services.dashboard.state import FleetState
from shared.kube.informer import TRANSIENT, Informer, key_of
from shared.kube.resources import PODS, Kube
from shared.kube.rest import ApiError
from shared.logs import get_logger
from shared.tasks import cancel_and_wait
from shared.workqueue import WorkQueue

log = get_logger(__name__)
Obj = dict[str, Any]
NAME = "gpu_dra_device_allocation_info"
LABELS = ["UUID", "Hostname", "namespace", "pod", "container", "claim"]
PodRef = tuple[str, str, str]  # (namespace, name, uid) of a reserved pod
READERS = 4  # pod reads at once (a restart reads every reserved pod)


class PodClaims(msgspec.Struct, frozen=True):
    """What the series need of one pod: its name and, per claim name, the containers that use the claim."""

    name: str
    containers: dict[str, tuple[str, ...]]


def pod_claims(pod: Obj) -> PodClaims:
    """A pod's claims -> the containers (init containers first, as the pod lists them) whose `resources.claims`
    name a claim reference resolving to it: `resourceClaimName`, or the claim generated from a template
    (`status.resourceClaimStatuses`); a claim for extended resources (`status.extendedResourceClaimStatus`) is
    used by the containers its request mappings name."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    generated = {s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []}
    resolved = {
        str(ref.get("name")): str(ref.get("resourceClaimName") or generated.get(ref.get("name")) or "")
        for ref in spec.get("resourceClaims") or []
    }
    containers: dict[str, list[str]] = {}

    def uses(claim: str, container: str) -> None:
        if claim and container not in containers.setdefault(claim, []):
            containers[claim].append(container)

    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        for use in (container.get("resources") or {}).get("claims") or []:
            uses(resolved.get(str(use.get("name")), ""), str(container.get("name") or ""))
    extended = status.get("extendedResourceClaimStatus") or {}
    for mapping in extended.get("requestMappings") or []:
        uses(str(extended.get("resourceClaimName") or ""), str(mapping.get("containerName") or ""))
    return PodClaims(
        name=str((pod.get("metadata") or {}).get("name") or ""),
        containers={claim: tuple(names) for claim, names in containers.items()},
    )


def reserved_pods(claim: Obj | None) -> list[PodRef]:
    ns = key_of(claim or {})[0]
    return [
        (ns, str(r.get("name") or ""), str(r.get("uid") or ""))
        for r in ((claim or {}).get("status") or {}).get("reservedFor") or []
        if r.get("resource", "pods") == "pods" and r.get("uid")
    ]


def device_uuids(slices: Iterable[Obj]) -> dict[model.DeviceKey, tuple[str, str]]:
    """(driver, pool, device) -> (UUID, node) of every device with a `uuid` attribute."""
    out: dict[model.DeviceKey, tuple[str, str]] = {}
    for rslice in slices:
        spec = rslice.get("spec") or {}
        driver, pool, node = (
            str(spec.get("driver") or ""),
            str((spec.get("pool") or {}).get("name") or ""),
            model.slice_node(rslice),
        )
        for device in spec.get("devices") or []:
            uuid = model.attr(device, "uuid")
            if uuid:
                out[(driver, pool, str(device.get("name") or ""))] = (uuid, node)
    return out


def allocation_samples(
    claims: Iterable[Obj], uuids: Mapping[model.DeviceKey, tuple[str, str]], pods: Mapping[str, PodClaims]
) -> list[list[str]]:
    """Label values (LABELS' order) of one series per device with a UUID x reserving pod x container using the
    claim (container "" when none names it); a pod not read yet has none."""
    out: set[tuple[str, ...]] = set()
    for claim in claims:
        ns, name = key_of(claim)
        holders = [
            (pod.name, pod.containers.get(name) or ("",))
            for pod in (pods.get(uid) for _, _, uid in reserved_pods(claim))
            if pod is not None
        ]
        for device in model.claim_devices(claim):
            uuid, node = uuids.get(device, ("", ""))
            if uuid:
                out.update(
                    (uuid, node, ns, pod, container, name) for pod, containers in holders for container in containers
                )
    return [list(labels) for labels in sorted(out)]


class AllocationInfo(Collector):
    """Feed `on_claim` every claim change and run `run()`; register it with a registry to export the series."""

    def __init__(self, kube: Kube, claims: Informer, slices: Informer) -> None:
        self.kube, self.claims, self.slices = kube, claims, slices
        self.pods: dict[str, PodClaims] = {}  # pod uid -> what it was read as
        self._reserving: dict[str, set[tuple[str, str]]] = {}  # pod uid -> the claims reserved for it
        self.queue: WorkQueue[PodRef] = WorkQueue()

    def on_claim(self, event: str, obj: Obj, old: Obj | None) -> None:
        key = key_of(obj)
        now = set(reserved_pods(obj)) if event != "DELETED" else set()
        for _, _, uid in set(reserved_pods(old)) - now:
            claims = self._reserving.get(uid, set())
            claims.discard(key)
            if not claims:
                self._reserving.pop(uid, None)
                self.pods.pop(uid, None)
        for ref in now:
            self._reserving.setdefault(ref[2], set()).add(key)
            if ref[2] not in self.pods:
                self.queue.add(ref)

    async def run(self, stopping: asyncio.Event) -> None:
        """Read the reserved pods until `stopping`."""
        readers = [asyncio.create_task(self._read_pods(), name=f"dashboard-pod-reader-{i}") for i in range(READERS)]
        try:
            await stopping.wait()
        finally:
            self.queue.close()
            await cancel_and_wait(readers)

    async def _read_pods(self) -> None:
        while True:
            ref, _ = await self.queue.get()
            try:
                await self._read(ref)
            except (ApiError, *TRANSIENT) as exc:
                if isinstance(exc, ApiError) and exc.not_found:
                    self.queue.backoffs.pop(ref, None)  # gone: its claims are unreserved soon
                else:
                    log.warning(
                        "cannot read a reserved pod; retrying",
                        pod=f"{ref[0]}/{ref[1]}",
                        error=str(exc),
                        retry_s=round(self.queue.retry(ref), 2),
                    )
            else:
                self.queue.backoffs.pop(ref, None)
            finally:
                self.queue.done(ref)

    async def _read(self, ref: PodRef) -> None:
        ns, name, uid = ref
        if uid not in self._reserving or uid in self.pods:
            return
        pod = await self.kube.get(PODS, ns, name)
        if str((pod.get("metadata") or {}).get("uid") or "") == uid and uid in self._reserving:
            self.pods[uid] = pod_claims(pod)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        # copies taken at once (the scrape runs on the endpoint's thread, the caches change on the event loop)
        claims, slices, pods = list(self.claims.objects.values()), list(self.slices.objects.values()), dict(self.pods)
        for labels in allocation_samples(claims, device_uuids(slices), pods):
            family.add_metric(labels, 1.0)
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            NAME,
            "1 per device (by UUID) x pod x container holding it through a claim, as DCGM-exporter's pod mapping",
            labels=LABELS,
        )


@contextlib.asynccontextmanager
async def exported(state: FleetState, registry: CollectorRegistry = REGISTRY) -> AsyncIterator[AllocationInfo]:
    """The series of `state`'s claims and slices in `registry` while inside (before `state.run()` lists, so that
    every listed claim is seen)."""
    assert state.kube is not None, "a FleetState without a Kube watches nothing"
    info = AllocationInfo(state.kube, state.claims, state.slices)
    state.claim_listeners.append(info.on_claim)
    registry.register(info)
    stopping = asyncio.Event()
    reading = asyncio.create_task(info.run(stopping), name="dashboard-allocation-info")
    try:
        yield info
    finally:
        stopping.set()
        await reading
        registry.unregister(info)
        state.claim_listeners.remove(info.on_claim)
