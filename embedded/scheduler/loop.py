"""The local cluster's scheduler: informers over the API, then one scheduling decision at a time.

Owns the control loop. Seven informers (list, then watch from the list's resourceVersion, re-list
on 410 Gone) keep a ClusterState; any event wakes the loop. A pass (1) releases claims whose
consumers are gone or done, (2) generates missing claims (templates, extended resources), (3) tries
each pending pod of ours in creation order: a Plan, then the claim writes and the binding, or
PodScheduled=False. Step (2) writes every pod's claims at once. In step (3) a decision's claim
writes are assumed in the cache (the next decision sees the devices taken) and sent, followed by
the binding and the Event, while the pass decides the next pods and the loop goes on to the next
pass (a failed write puts the cache back as it was; its error fails the next pass, as an error in
the pass itself does). A pod that did not fit is tried again only after a relevant change (slices,
classes, nodes, namespaces, a claim freed or changed) or the slow backstop resync. Every attempt
is a span `scheduler.schedule_pod`.

No selector that could take long runs on the event loop: before a pod is planned, the selectors
its claims use that may not run inline (`celsandbox.offloaded`) are evaluated in the CEL worker
process by a background task, and the pod waits (skipped, not marked tried) until they are; the
pass goes on with the other pods. Stopping cancels those tasks and kills the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient
from opentelemetry import trace

from embedded.scheduler import celworker
from embedded.scheduler.binding import DONE_PHASES, SCHEDULER_NAME, ClaimWrite, Conflict, Writer
from embedded.scheduler.cel import CelError, Selector
from embedded.scheduler.celsandbox import CelSandbox
from embedded.scheduler.claimgen import ClaimGenerator
from embedded.scheduler.plan import IndexCache, Plan, plan_pod
from embedded.scheduler.pools import SliceIndex
from embedded.scheduler.requests import claim_selectors
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
from shared.tasks import cancel_and_wait
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

    def __init__(
        self,
        api_client: ApiClient,
        resync_seconds: float = 30.0,
        watch_timeout_s: int = 300,
        cel_cpu_seconds: float = celworker.CPU_LIMIT_S,
    ) -> None:
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
        self._writes: list[asyncio.Task[None]] = []  # claim writes, bindings and Events in flight
        self._binding: set[str] = set()  # pods whose claim writes and binding are in flight: not tried again
        self.cel = CelSandbox(cpu_s=cel_cpu_seconds)
        self._settling: dict[str, asyncio.Task[None]] = {}  # selector -> its evaluation in the CEL worker

    # ---- informers --------------------------------------------------------------------------------

    def _changed(self, res: Resource, event: str, obj: Obj | None, old: Obj | None) -> None:
        if res in (RESOURCESLICES, DEVICECLASSES, NODES, NAMESPACES):
            self.generation += 1
            if res is RESOURCESLICES:
                self.index.dirty = True
        elif res is RESOURCECLAIMS and obj is not None:
            if (
                event == "DELETED"
                or (_allocation_of(old) and not _allocation_of(obj))
                or (old is not None and old.get("spec") != obj.get("spec"))
            ):
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
                    self._reap()
                    await self.run_pass(wait=False)
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
            await cancel_and_wait(list(self._settling.values()))
            await self.cel.close()
            writes, self._writes = self._writes, []
            await cancel_and_wait(writes)
            for write in writes:
                if not write.cancelled() and write.exception() is not None:
                    log.warning("a write failed as the scheduler stopped", error=str(write.exception()))
            for task in informers:
                task.cancel()
            await asyncio.gather(*informers, return_exceptions=True)

    async def run_pass(self, wait: bool = True) -> None:
        """One pass; with `wait`, it returns once its writes are done (the loop goes on while they are on their way:
        the cache already has them, and the next pass reaps their errors)."""
        if await self.writer.release():
            self.generation += 1
        pods = [p for p in self.state.values(PODS) if is_ours(p)]
        pods.sort(key=self.state.pod_order)
        live = {p["metadata"].get("uid") for p in pods}
        for uid in [u for u in self.tried if u not in live]:
            del self.tried[uid]
        # Generated claims need no decision: every pod's are written at once, not one round trip after another.
        generated = await asyncio.gather(*(self._generate_claims(pod) for pod in pods))
        try:
            for pod, ok in zip(pods, generated, strict=True):
                if not ok:
                    continue
                ns, name = key_of(pod)
                current = self.state.get(PODS, ns, name)
                if current is None or not is_ours(current) or current["metadata"].get("uid") in self._binding:
                    continue
                await self.schedule_one(current)
        finally:
            if wait:
                await self._writes_done()

    async def _generate_claims(self, pod: Obj) -> bool:
        try:
            await self.claimgen.ensure(pod)
        except ApiError as exc:
            ns, name = key_of(pod)
            log.warning("could not generate the pod's claims", pod=f"{ns}/{name}", error=str(exc))
            return False
        return True

    def _write_later(self, write: Coroutine[Any, Any, None]) -> None:
        """Claim writes, bindings and Events go out while the next pods are decided."""
        self._writes.append(asyncio.create_task(write))

    def _reap(self) -> None:
        """Forget the writes that are done; raise the first error among them (the pass fails, as if it had waited)."""
        done = [w for w in self._writes if w.done()]
        self._writes = [w for w in self._writes if not w.done()]
        errors = [w.exception() for w in done if not w.cancelled()]
        for error in errors:
            if error is not None:
                raise error

    async def _writes_done(self) -> None:
        writes, self._writes = self._writes, []
        if not writes:
            return
        try:
            results = await asyncio.gather(*writes, return_exceptions=True)
        except asyncio.CancelledError:
            await cancel_and_wait(writes)
            raise
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def schedule_one(self, pod: Obj) -> str | None:
        """One attempt for one pod: the node it is being bound to (its writes go out in the background), or None."""
        md = pod["metadata"]
        uid = md.get("uid", "")
        stamp = (self.generation, md.get("generation"))
        if self.tried.get(uid) == stamp:
            return None
        names, _ = self.state.pod_claim_names(pod)
        if any((md.get("namespace", ""), name) in self.state.assumed for name in names):
            await self._writes_done()  # it shares a claim with a pod decided in this pass: that write goes first
        span_attributes = {
            "k8s.namespace.name": md.get("namespace", ""),
            "k8s.pod.name": md.get("name", ""),
            "k8s.pod.uid": uid,
        }
        with tracer.start_as_current_span(
            "scheduler.schedule_pod", attributes=span_attributes, end_on_exit=False
        ) as span:
            binding = False
            try:
                index = self.index.get(self.state)
                waiting = self.cel.unsettled(self._pod_selectors(pod), index)
                if waiting:
                    span.set_attribute("gpu_dra.outcome", "evaluating")
                    self._settle_later(waiting, index)
                    return None
                plan = plan_pod(self.state, pod, index)
                span.set_attribute("gpu_dra.claims", len(plan.claims))
                if plan.node is None:
                    span.set_attribute("gpu_dra.outcome", "waiting" if plan.missing else "unschedulable")
                    if not plan.missing:
                        self.tried[uid] = stamp
                    if await self.writer.mark_unschedulable(pod, plan.message):
                        self._write_later(self.writer.event(pod, "FailedScheduling", plan.message, warning=True))
                        log.info("pod unschedulable", pod=plan.pod, reason=plan.message[:300])
                    return None
                span.set_attribute("k8s.node.name", plan.node)
                try:
                    writes = self.writer.reservation(plan, pod)
                except Conflict as exc:
                    self._conflict(span, plan, exc)
                    return None
                self.writer.assume_bound(pod, plan.node)
                self.tried.pop(uid, None)
                self._binding.add(uid)
                self._write_later(self._bind(pod, plan, writes, span))
                binding = True
                return plan.node
            finally:
                if not binding:
                    span.end()

    def _pod_selectors(self, pod: Obj) -> list[Selector]:
        """The selectors of the pod's claims still to allocate (their classes' included)."""
        names, missing = self.state.pod_claim_names(pod)
        if missing:
            return []
        ns = pod["metadata"].get("namespace", "")
        claims = [
            c for c in (self.state.get(RESOURCECLAIMS, ns, n) for n in names) if c is not None and not _allocation_of(c)
        ]
        return claim_selectors(claims, self.state.classes()) if claims else []

    def _settle_later(self, selectors: list[Selector], index: SliceIndex) -> None:
        """Have the CEL worker evaluate `selectors` over `index` in the background; the loop wakes when done."""
        for selector in selectors:
            if selector.expression not in self._settling:
                self._settling[selector.expression] = asyncio.create_task(
                    self._settle(selector, index), name="cel-settle"
                )

    async def _settle(self, selector: Selector, index: SliceIndex) -> None:
        try:
            await self.cel.settle(selector, index)
        except Exception as exc:  # a worker that cannot run fails the selector; its pods get the reason
            log.warning("CEL worker failed", error=str(exc))
            selector.failure = CelError(selector.expression, f"the CEL worker failed: {exc}")
        finally:
            self._settling.pop(selector.expression, None)
            self.wake.set()

    def _conflict(self, span: trace.Span, plan: Plan, exc: Conflict) -> None:
        span.set_attribute("gpu_dra.outcome", "conflict")
        log.info("claim changed during scheduling; trying again", pod=plan.pod, error=str(exc))
        self.wake.set()

    async def _bind(self, pod: Obj, plan: Plan, writes: list[ClaimWrite], span: trace.Span) -> None:
        """Send the pod's claim writes and its binding (in the pod's scheduling span), then the Scheduled Event.
        A failed write leaves the claims and the pod cached as they were; the pass then fails (and is retried
        after 1 s) unless it was a conflict (retried at once, with the fresh claim)."""
        assert plan.node is not None
        try:
            await self._write_binding(pod, plan, writes, span)
        finally:
            self._binding.discard(pod["metadata"].get("uid", ""))

    async def _write_binding(self, pod: Obj, plan: Plan, writes: list[ClaimWrite], span: trace.Span) -> None:
        assert plan.node is not None
        with trace.use_span(span, end_on_exit=True):
            try:
                await self.writer.reserve(writes, pod)
            except Conflict as exc:
                self.writer.unbind(pod)
                self._conflict(span, plan, exc)
                return
            except BaseException:
                self.writer.unbind(pod)
                raise
            await self.writer.bind(pod, plan.node)  # on failure the pod is cached unbound again
            span.set_attribute("gpu_dra.outcome", "bound")
        self.scheduled += 1
        log.info("pod bound", pod=plan.pod, node=plan.node, claims=len(plan.claims), allocated=len(plan.allocations))
        await self.writer.event(pod, "Scheduled", f"Successfully assigned {plan.pod} to {plan.node}")
