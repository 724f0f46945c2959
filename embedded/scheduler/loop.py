"""The local cluster's scheduler: informers over the API, then one scheduling decision at a time.

Owns the control loop. Seven informers (list, then watch from the list's resourceVersion, re-list
on 410 Gone) keep a ClusterState; any event wakes the loop. A pass (1) releases claims whose
consumers are gone or done, (2) generates missing claims (templates, extended resources), (3) tries
each pending pod of ours in creation order: a Plan, then the claim writes and the binding, or
PodScheduled=False. A pod that did not fit is tried again only after a relevant change (slices,
classes, nodes, namespaces, a claim freed or changed) or the slow backstop resync. Every attempt
is a span `scheduler.schedule_pod`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient

from embedded.scheduler.binding import DONE_PHASES, SCHEDULER_NAME, Conflict, Writer
from embedded.scheduler.claimgen import ClaimGenerator
from embedded.scheduler.plan import IndexCache, plan_pod
from embedded.scheduler.state import WATCHED, ClusterState
from shared.kube.informer import key_of, until_synced
from shared.kube.resources import (
    DEVICECLASSES,
    NAMESPACES,
    NODES,
    PODS,
    RESOURCECLAIMS,
    RESOURCECLAIMTEMPLATES,
    RESOURCESLICES,
    Kube,
    Resource,
)
from shared.kube.rest import ApiError, Gone
from shared.logs import get_logger
from shared.telemetry import get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)
Obj = dict[str, Any]
TRANSIENT = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


def is_ours(pod: Obj) -> bool:
    """Pending, not deleting, and for the default scheduler."""
    spec, md = pod.get("spec") or {}, pod.get("metadata") or {}
    if spec.get("nodeName") or md.get("deletionTimestamp"):
        return False
    if (pod.get("status") or {}).get("phase") in DONE_PHASES:
        return False
    return (spec.get("schedulerName") or SCHEDULER_NAME) == SCHEDULER_NAME


def _allocation_of(claim: Obj | None) -> Any:
    return ((claim or {}).get("status") or {}).get("allocation")


class Scheduler:
    """`await Scheduler(api_client).run(stopping)` schedules pods until `stopping` is set."""

    def __init__(self, api_client: ApiClient, resync_seconds: float = 30.0, watch_timeout_s: int = 300) -> None:
        self.kube = Kube(api_client)
        self.state = ClusterState()
        self.index = IndexCache()
        self.writer = Writer(self.kube, self.state)
        self.claimgen = ClaimGenerator(self.kube, self.state)
        self.resync_seconds = resync_seconds
        self.watch_timeout_s = watch_timeout_s
        self.wake = asyncio.Event()
        self.synced = {res.plural: asyncio.Event() for res in WATCHED}
        self.ready = asyncio.Event()  # every informer has listed once
        self.generation = 0  # bumped by changes that may make an unschedulable pod fit
        self.tried: dict[str, tuple[int, Any]] = {}  # pod uid -> (generation, pod generation) of its last miss
        self.scheduled = 0
        self.lists = {res.plural: 0 for res in WATCHED}  # full lists per resource (1 + re-lists)

    # ---- informers --------------------------------------------------------------------------------

    def _changed(self, res: Resource, event: str, obj: Obj | None, old: Obj | None) -> None:
        if res in (RESOURCESLICES, DEVICECLASSES, NODES, NAMESPACES):
            self.generation += 1
            if res is RESOURCESLICES:
                self.index.dirty = True
        elif res is RESOURCECLAIMS and obj is not None:
            if event == "DELETED" or (_allocation_of(old) and not _allocation_of(obj)) or (
                    old is not None and old.get("spec") != obj.get("spec")):
                self.generation += 1
        elif res is RESOURCECLAIMS or res is RESOURCECLAIMTEMPLATES:
            self.generation += 1
        self.wake.set()

    async def _inform(self, res: Resource, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                items, rv = await self.kube.list(res)
                self.lists[res.plural] += 1
                self.state.replace_all(res, items)
                if res is RESOURCESLICES:
                    self.index.dirty = True
                self.generation += 1
                self.wake.set()
                self.synced[res.plural].set()
                while not stopping.is_set():
                    async for event, obj in self.kube.watch(res, rv, timeout_s=self.watch_timeout_s):
                        rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                        if event == "BOOKMARK":
                            continue
                        old = self.state.apply(res, event, obj)
                        self._changed(res, event, obj, old)
            except Gone:
                log.info("watch expired; re-listing", resource=res.plural)
            except (ApiError, *TRANSIENT) as exc:
                log.warning("informer failed; re-listing in 1 s", resource=res.plural, error=str(exc))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopping.wait(), 1.0)

    # ---- the loop ---------------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        informers = [asyncio.create_task(self._inform(res, stopping), name=f"inform-{res.plural}") for res in WATCHED]
        try:
            if not await until_synced(self.synced.values(), stopping):
                return
            self.ready.set()
            log.info("scheduler synced", pods=len(self.state.values(PODS)), nodes=len(self.state.values(NODES)))
            while not stopping.is_set():
                self.wake.clear()
                try:
                    await self.run_pass()
                except (ApiError, *TRANSIENT) as exc:
                    log.warning("scheduling pass failed; retrying in 1 s", error=str(exc))
                    self.wake.set()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stopping.wait(), 1.0)
                    continue
                waits = [asyncio.ensure_future(self.wake.wait()), asyncio.ensure_future(stopping.wait())]
                done, _ = await asyncio.wait(waits, timeout=self.resync_seconds, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                if not done:
                    self.generation += 1  # the backstop: unschedulable pods get another look
        finally:
            for task in informers:
                task.cancel()
            await asyncio.gather(*informers, return_exceptions=True)

    async def run_pass(self) -> None:
        if await self.writer.release():
            self.generation += 1
        pods = [p for p in self.state.values(PODS) if is_ours(p)]
        pods.sort(key=self.state.pod_order)
        live = {p["metadata"].get("uid") for p in pods}
        for uid in [u for u in self.tried if u not in live]:
            del self.tried[uid]
        for pod in pods:
            ns, name = key_of(pod)
            try:
                await self.claimgen.ensure(pod)
            except ApiError as exc:
                log.warning("could not generate the pod's claims", pod=f"{ns}/{name}", error=str(exc))
                continue
            current = self.state.get(PODS, ns, name)
            if current is None or not is_ours(current):
                continue
            await self.schedule_one(current)

    async def schedule_one(self, pod: Obj) -> str | None:
        """One attempt for one pod; the node it was bound to, or None."""
        md = pod["metadata"]
        uid = md.get("uid", "")
        stamp = (self.generation, md.get("generation"))
        if self.tried.get(uid) == stamp:
            return None
        with tracer.start_as_current_span("scheduler.schedule_pod", attributes={
                "k8s.namespace.name": md.get("namespace", ""), "k8s.pod.name": md.get("name", ""),
                "k8s.pod.uid": uid}) as span:
            plan = plan_pod(self.state, pod, self.index.get(self.state))
            span.set_attribute("gpu_dra.claims", len(plan.claims))
            if plan.node is None:
                span.set_attribute("gpu_dra.outcome", "waiting" if plan.missing else "unschedulable")
                if not plan.missing:
                    self.tried[uid] = stamp
                if await self.writer.mark_unschedulable(pod, plan.message):
                    await self.writer.event(pod, "FailedScheduling", plan.message, warning=True)
                    log.info("pod unschedulable", pod=plan.pod, reason=plan.message[:300])
                return None
            span.set_attribute("k8s.node.name", plan.node)
            try:
                await self.writer.reserve(plan, pod)
            except Conflict as exc:
                span.set_attribute("gpu_dra.outcome", "conflict")
                log.info("claim changed during scheduling; trying again", pod=plan.pod, error=str(exc))
                self.wake.set()
                return None
            await self.writer.bind(pod, plan.node)
            span.set_attribute("gpu_dra.outcome", "bound")
            self.tried.pop(uid, None)
            self.scheduled += 1
            await self.writer.event(pod, "Scheduled", f"Successfully assigned {plan.pod} to {plan.node}")
            log.info("pod bound", pod=plan.pod, node=plan.node, claims=len(plan.claims),
                     allocated=len(plan.allocations))
            return plan.node
