"""The kubelet emulator's pod loop for one node: prepare the claims of the pods bound to it, run them,
finish them.

Owns the watch of the node's pods (a task per event: pods side by side, one pod's events in order), the
check that each claim is allocated and reserved for the pod, `NodePrepareResources` per driver (one call
at a time), the pod's status (Running/Ready, or Pending with `ContainerCreating` and a Warning Event
`FailedPrepareDynamicResources`), its containers (`containers.PodWorker` with a `Runtime`), termination,
`NodeUnprepareResources` after the last pod using a claim, and the grace-period-0 delete. What it prepared
survives restarts (`state.py`). A failed prepare is retried after RETRY_MIN doubling to RETRY_MAX, and at
once when a plugin registers: sooner than a real kubelet, which syncs such a pod again at its resync
(`--sync-frequency`, 1 min jittered).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client

from embedded.kubelet import metrics as kubelet_metrics
from embedded.kubelet.client import Claim, PluginError
from embedded.nodeagent.cdi_resolve import CdiResolutionError, SpecCache
from embedded.nodeagent.containers import PodWorker
from embedded.nodeagent.kubeletevents import EventRecorder
from embedded.nodeagent.podclaims import (
    EDITS_ANNOTATION,
    DraClient,
    PreparedClaim,
    PrepareFailed,
    container_edits,
    fill_resource_health,
    is_ready,
    pod_claims,
    pod_status,
    status_inputs,
)
from embedded.nodeagent.podwatch import watch_node_pods
from embedded.nodeagent.preparedclaims import PreparedClaims
from embedded.nodeagent.resourcehealth import DeviceHealthCache, DeviceKey
from embedded.nodeagent.sandbox import Runtime
from shared.backoff import Backoff
from shared.keyedlocks import KeyedLocks
from shared.kube.events import event_body, record_event
from shared.kube.resources import PODS, RESOURCECLAIMS
from shared.kube.rest import ApiError, decode, request
from shared.logs import get_logger
from shared.tasks import cancel_and_wait, cancelling
from shared.telemetry import CLAIM_TRACEPARENT_ANNOTATION

log = get_logger(__name__)
EXIT_ANNOTATION = "gpu-dra.nvidia.com/emulate-exit"
FAILED_REASON = "FailedPrepareDynamicResources"  # the kubelet's Event reason (pkg/kubelet/events)
KUBELET_COMPONENT = "kubelet"
RETRY_MIN, RETRY_MAX = 0.2, 5.0  # a waiting pod's retries (module doc: a real kubelet's are 60-90 s apart)
STRATEGIC_PATCH = "application/strategic-merge-patch+json"  # what the kubelet sends (conditions merged by type)
FIRST_STATUS_WAIT_S = 0.5  # a Running pod's first status waits this long at most for its containers to start


class PodRunner:
    """Runs this node's pods: their claims prepared, their containers (with a Runtime) executed."""

    def __init__(
        self,
        node: str,
        api: client.ApiClient,
        dra: DraClient,
        cdi_dirs: list[Path],
        resync_seconds: float = 30.0,
        on_change: Callable[[], None] | None = None,
        state_dir: Path | None = None,
        runtime: Runtime | None = None,
        health: DeviceHealthCache | None = None,
    ):
        self.node = node
        self.health = health  # the plugins' device health: each container status's allocatedResourcesStatus
        if health is not None:
            health.on_change = self.health_changed
        self._health_writes: set[asyncio.Task[None]] = set()
        self.api = api  # raw JSON calls (`shared.kube.rest`): pods and claims are dicts, never decoded into models
        self.dra = dra
        self.cdi_dirs = cdi_dirs
        self._specs: SpecCache = {}  # the CDI specs read so far (a file is read again only when it changed)
        self.resync_seconds = resync_seconds
        self.claims = PreparedClaims(node, dra, state_dir)
        kubelet_metrics.CLAIMS_IN_USE.track(self.claims)
        self.pods: dict[str, dict[str, Any]] = {}  # pod uid -> last seen pod
        self._lock = asyncio.Lock()  # the prepared claims, the DRA calls and the state file: one at a time
        self._pod_locks: KeyedLocks[str] = KeyedLocks()  # pod uid -> held while one of its events is handled
        self._events: set[asyncio.Task[None]] = set()  # watch events being handled (pods side by side)
        self._on_change = on_change
        self._retry: set[str] = set()
        self._attempted: dict[str, str] = {}  # pod uid -> inputs of the last failed attempt
        self._reported: dict[str, str] = {}  # pod uid -> the last FailedPrepareDynamicResources message
        self.runtime = runtime
        self.events = EventRecorder(api, node)  # the containers' Events (Pulled, Created, Started, ...)
        self.workers: dict[str, PodWorker] = {}  # pod uid -> its running (or finished) containers
        self._finished: set[str] = set()  # pods whose (emulated) exit was written: never prepared again
        self._terminating: set[str] = set()  # pods whose containers are being stopped (grace period)
        self._deleted: set[str] = set()  # pods whose final delete was made: their late events call for nothing
        self._writes: dict[str, asyncio.Task[None]] = {}  # pod uid -> its status writer
        self._edits: dict[str, dict[str, Any]] = {}  # pod uid -> its edits annotation, until a status write carries it
        self._stops: dict[str, asyncio.Task[None]] = {}  # pod uid -> its termination (grace period, then delete)

    @property
    def prepared(self) -> dict[str, PreparedClaim]:
        """Claim uid -> what this node prepared for it (`PreparedClaims`)."""
        return self.claims.by_uid

    # ------------------------------------------------------------------ API helpers
    async def _get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = decode(await request(self.api, "GET", RESOURCECLAIMS.path(namespace, name)))
        return obj

    async def _patch_pod(self, meta: dict[str, Any], body: dict[str, Any], subresource: str | None = None) -> None:
        await request(
            self.api,
            "PATCH",
            PODS.path(meta["namespace"], meta["name"], subresource),
            body=body,
            content_type=STRATEGIC_PATCH,
        )

    async def _write_status(
        self, pod: dict[str, Any], status: dict[str, Any], edits: dict[str, Any] | None = None
    ) -> None:
        """One pods/status PATCH; the edits annotation rides on it (a pod status write keeps metadata changes,
        as kube-apiserver's pod status strategy does: one request, and the pod shows its edits with its status)."""
        self._add_resource_health(pod, status.get("containerStatuses") or [])
        body: dict[str, Any] = {"status": status}
        if edits is not None:
            body["metadata"] = {"annotations": {EDITS_ANNOTATION: json.dumps(edits, sort_keys=True)}}
        await self._patch_pod(pod["metadata"], body, "status")

    # ------------------------------------------------------------------ device health (KEP-4680)
    def _add_resource_health(self, pod: dict[str, Any], statuses: list[dict[str, Any]]) -> bool:
        """Set each container status's `allocatedResourcesStatus`; True when any container has one."""
        return self.health is not None and fill_resource_health(pod, statuses, self.prepared.values(), self.health)

    def health_changed(self, devices: set[DeviceKey]) -> None:
        """Rewrite the allocatedResourcesStatus of the pods holding a device whose health changed."""
        pods = {
            uid
            for state in self.prepared.values()
            if any((d, dev.pool, dev.device) in devices for d in state.drivers for dev in state.devices)
            for uid in state.pods
        }
        for uid in pods:
            pod = self.pods.get(uid)
            if pod is not None and uid not in self._deleted:
                task = asyncio.create_task(self._write_resource_health(pod))
                self._health_writes.add(task)
                task.add_done_callback(self._health_writes.discard)

    async def _write_resource_health(self, pod: dict[str, Any]) -> None:
        """One pods/status strategic merge patch of the containers' allocatedResourcesStatus only (merged by
        container name: the rest of each status stays as the last full write left it)."""
        statuses = [{"name": c["name"]} for c in (pod.get("spec") or {}).get("containers") or []]
        if not self._add_resource_health(pod, statuses):
            return
        statuses = [s for s in statuses if "allocatedResourcesStatus" in s]
        try:
            await self._patch_pod(pod["metadata"], {"status": {"containerStatuses": statuses}}, "status")
        except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
            log.warning(
                "device health not written to the pod; the next status write carries it",
                pod=pod["metadata"]["name"],
                error=str(exc),
            )

    # ------------------------------------------------------------------ prepare / unprepare
    async def _prepare_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        ns, uid = meta["namespace"], meta["uid"]
        names, uses = pod_claims(pod)
        wanted: dict[str, Claim] = {}
        drivers_of: dict[str, set[str]] = {}
        traceparents: dict[str, str] = {}  # the claim's trace, started by the scheduler: the call joins it
        for name in names:
            try:
                claim = await self._get_claim(ns, name)
            except ApiError as exc:
                if exc.status == 404:
                    raise PrepareFailed(f"ResourceClaim {ns}/{name} does not exist") from exc
                raise
            status = claim.get("status") or {}
            if not any(r.get("uid") == uid for r in status.get("reservedFor") or []):
                raise PrepareFailed(
                    f"ResourceClaim {ns}/{name} is not reserved for this pod "
                    f"(the scheduler reserves it; check status.reservedFor)"
                )
            results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
            if not status.get("allocation"):
                raise PrepareFailed(f"ResourceClaim {ns}/{name} is not allocated")
            ref = Claim(namespace=ns, uid=claim["metadata"]["uid"], name=name)
            wanted[ref.uid] = ref
            drivers_of[ref.uid] = {r["driver"] for r in results}
            traceparents[ref.uid] = (claim["metadata"].get("annotations") or {}).get(CLAIM_TRACEPARENT_ANNOTATION, "")
        async with self._lock:
            with kubelet_metrics.operation("PrepareResources"):
                prepared = await self.claims.prepare(uid, wanted, drivers_of, traceparents)
        await self.claims.save()
        edits = container_edits(pod, prepared, uses, self.cdi_dirs, self._specs)
        if self.runtime is not None:
            # The worker's writer writes the status from here on; its first write carries the annotation (a
            # Running pod shows what its containers got).
            self._edits[uid] = edits
            self._start_worker(pod, edits)
            return
        await self._write_status(pod, pod_status(pod, phase="Running"), edits)
        log.info("pod running", node=self.node, pod=f"{ns}/{meta['name']}", claims=len(wanted))
        code = (meta.get("annotations") or {}).get(EXIT_ANNOTATION)
        if code is not None:
            exit_code = int(code) if code.strip().lstrip("-").isdigit() else 1
            phase = "Succeeded" if exit_code == 0 else "Failed"
            await self._write_status(pod, pod_status(pod, phase=phase, exit_code=exit_code))
            self._finished.add(uid)
            log.info("pod exited (emulated)", node=self.node, pod=f"{ns}/{meta['name']}", exit_code=exit_code)
            async with self._lock:
                await self._release_pod(uid)

    async def _release_pod(self, pod_uid: str) -> bool:
        """Drop the pod from its claims, unprepare the ones nobody uses; True when none failed."""
        if not self.claims.holds(pod_uid):  # a sweep of orphaned claims, or a pod already released: no work
            return await self.claims.unprepare_unused(pod_uid)  # of a pod's UnprepareResources to count
        with kubelet_metrics.operation("UnprepareResources") as failed:
            ok = await self.claims.unprepare_unused(pod_uid)
            failed(not ok)
        return ok

    async def sync_pod(self, pod: dict[str, Any], force: bool = False) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        async with self._pod_locks.hold(uid):
            if await self._sync_locked(pod, force):
                await self._try_prepare(pod)  # the claim GETs and the pod writes outside the node-wide lock
        if self._on_change:
            self._on_change()

    async def _sync_locked(self, pod: dict[str, Any], force: bool) -> bool:
        """What a pod's event calls for, done under the node-wide lock; True when its claims are to be prepared."""
        meta = pod["metadata"]
        uid = meta["uid"]
        async with self._lock:
            self.pods[uid] = pod
            phase = (pod.get("status") or {}).get("phase", "Pending")
            worker = self.workers.get(uid)
            if uid in self._terminating:
                pass  # its containers are being stopped; the final delete follows
            elif uid in self._deleted:
                pass  # deleted by us: an event our own status writes caused, before the DELETED one
            elif meta.get("deletionTimestamp") and worker is not None:
                self._terminating.add(uid)
                grace = meta.get("deletionGracePeriodSeconds")
                self._stops[uid] = asyncio.create_task(
                    self._terminate(pod, worker, 30.0 if grace is None else float(grace))
                )
            elif meta.get("deletionTimestamp"):
                await self._finish_deleted(pod)
            elif worker is not None and worker.phase not in ("Succeeded", "Failed"):
                worker.add_ephemeral(pod)  # its containers run (the worker writes the status); `kubectl debug`'s
            elif phase in ("Succeeded", "Failed"):
                self._retry.discard(uid)
                if not await self._release_pod(uid):
                    self._retry.add(uid)
            elif phase == "Running" and is_ready(pod) and self.claims.holds(uid) and self.runtime is None:
                self._retry.discard(uid)
            elif uid in self._finished or worker is not None:
                pass  # exited: never started again (the old emulated exit wrote a Succeeded pod back to Pending)
            elif uid in self._retry and self._attempted.get(uid) == status_inputs(pod) and not force:
                pass  # our own Pending status coming back; the retry loop's backoff decides when to try again
            else:
                self._attempted[uid] = status_inputs(pod)
                return True
        return False

    # ------------------------------------------------------------------ containers
    def _start_worker(self, pod: dict[str, Any], edits: dict[str, dict[str, Any]]) -> None:
        rt = self.runtime
        assert rt is not None
        worker = PodWorker(
            pod,
            edits,
            bwrap=rt.bwrap,
            work_root=rt.work_root,
            log_root=rt.log_root,
            shim_dir=rt.shim_dir,
            sim_state=rt.sim_state,
            on_change=self._worker_changed,
            backoff_base=rt.backoff_base,
            on_event=lambda *event: self.events.container(pod, *event),
        )
        self.workers[pod["metadata"]["uid"]] = worker
        worker.start()
        log.info(
            "pod started",
            node=self.node,
            pod=f"{pod['metadata']['namespace']}/{pod['metadata']['name']}",
            containers=len(worker.mains),
            init_containers=len(worker.inits),
        )

    def _worker_changed(self, worker: PodWorker) -> None:
        """Write the worker's status: one writer per pod, which always writes the latest state."""
        uid = worker.pod["metadata"]["uid"]
        worker.dirty = True
        if uid in self._terminating:
            return  # its containers are being stopped: `_terminate` writes their final states once
        if uid not in self._writes or self._writes[uid].done():
            self._writes[uid] = asyncio.create_task(self._write_worker(worker))

    async def _write_worker(self, worker: PodWorker) -> None:
        if worker.phase == "Running" and not worker.started.is_set():
            # The containers are being started: wait (briefly) for them, so that one write says Running and Ready.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.started.wait(), FIRST_STATUS_WAIT_S)
        backoff = Backoff(initial_s=RETRY_MIN, cap_s=RETRY_MAX)
        while worker.dirty:
            worker.dirty = False
            uid = worker.pod["metadata"]["uid"]
            edits = self._edits.get(uid)
            try:
                await self._write_status(worker.pod, worker.status(), edits)
                if edits is not None and self._edits.get(uid) is edits:
                    del self._edits[uid]
                backoff.reset()
            except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                if isinstance(exc, ApiError) and exc.status == 404:
                    return  # the pod is gone
                log.warning("pod status not written; retrying", pod=worker.pod["metadata"]["name"], error=str(exc))
                worker.dirty = True
                await asyncio.sleep(backoff.next())
        if worker.phase in ("Succeeded", "Failed"):
            log.info("pod finished running", node=self.node, pod=worker.pod["metadata"]["name"], phase=worker.phase)

    async def _terminate(self, pod: dict[str, Any], worker: PodWorker, grace: float) -> None:
        uid = pod["metadata"]["uid"]
        try:
            await worker.stop(grace)
            pending = self._writes.pop(uid, None)
            if pending is not None:
                pending.cancel()
            edits = self._edits.pop(uid, None)
            if worker.dirty:  # the containers' final states, in one write before the final delete
                worker.dirty = False
                with contextlib.suppress(ApiError, OSError, TimeoutError, aiohttp.ClientError):
                    await self._write_status(pod, worker.status(), edits)
            async with self._lock:
                self.workers.pop(uid, None)
                await self._finish_deleted(pod)
        finally:
            self._terminating.discard(uid)
            self._stops.pop(uid, None)

    async def stop_all(self) -> None:
        """The emulator stops: its containers go with it (SIGTERM, 2 s, SIGKILL)."""
        await asyncio.gather(*(w.stop(2.0) for w in self.workers.values()), return_exceptions=True)
        for task in self._writes.values():
            task.cancel()

    async def _finish_deleted(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        if not await self._release_pod(uid):
            self._retry.add(uid)
            return
        try:
            await request(
                self.api,
                "DELETE",
                PODS.path(meta["namespace"], meta["name"]),
                body={
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": uid},
                },
            )
            log.info("pod finished", node=self.node, pod=f"{meta['namespace']}/{meta['name']}")
        except ApiError as exc:
            if exc.status not in (404, 409):
                log.warning("final pod delete failed; will retry", pod=meta["name"], status=exc.status)
                self._retry.add(uid)
                return
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:  # API server away: the retry loop tries again
            log.warning("final pod delete failed; will retry", pod=meta["name"], error=str(exc))
            self._retry.add(uid)
            return
        self._retry.discard(uid)
        self._deleted.add(uid)

    async def _try_prepare(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        try:
            await self._prepare_pod(pod)
            self._retry.discard(uid)
            self._reported.pop(uid, None)
        except (PrepareFailed, CdiResolutionError, PluginError, ApiError, aiohttp.ClientError) as exc:
            self._retry.add(uid)
            reason = f"{exc.status} {exc.reason}" if isinstance(exc, ApiError) else str(exc)
            log.info("pod not ready yet", node=self.node, pod=f"{meta['namespace']}/{meta['name']}", reason=reason)
            with contextlib.suppress(ApiError, OSError, TimeoutError, aiohttp.ClientError):
                if isinstance(exc, (PrepareFailed, CdiResolutionError, PluginError)):
                    await self._failed_event(pod, f"Failed to prepare dynamic resources: {reason}")
                await self._write_status(pod, pod_status(pod, phase="Pending"))

    async def _failed_event(self, pod: dict[str, Any], message: str) -> None:
        """The kubelet's Warning Event on the pod; once per distinct message (its recorder aggregates repeats)."""
        meta = pod["metadata"]
        if self._reported.get(meta["uid"]) == message:
            return
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": meta["namespace"],
            "name": meta["name"],
            "uid": meta["uid"],
        }
        body = event_body(
            involved,
            reason=FAILED_REASON,
            message=message,
            type="Warning",
            component=KUBELET_COMPONENT,
            instance=self.node,
        )
        if await record_event(self.api, body):
            self._reported[meta["uid"]] = message

    async def forget_pod(self, uid: str) -> None:
        async with self._pod_locks.hold(uid):
            worker = self.workers.pop(uid, None)
            self._edits.pop(uid, None)
            if worker is not None:
                await worker.stop(0.0)
            async with self._lock:
                self._finished.discard(uid)
                self._deleted.discard(uid)
                self.pods.pop(uid, None)
                self._retry.discard(uid)
                self._attempted.pop(uid, None)
                self._reported.pop(uid, None)
                if not await self._release_pod(uid):
                    log.warning("claims of a vanished pod not unprepared; the next re-list retries", pod_uid=uid)
        if self._on_change:
            self._on_change()

    async def prune(self, present: set[str]) -> None:
        """After a (re-)list: pods that vanished (also while we were down) give their claims up."""
        gone = {p for s in self.prepared.values() for p in s.pods} - present
        gone |= set(self.pods) - present
        orphaned = [u for u, s in self.prepared.items() if not s.pods]
        for uid in gone:
            await self.forget_pod(uid)
        if orphaned and not gone:
            async with self._lock:
                await self._release_pod("")

    async def retry_pending(self) -> None:
        """Try again the pods that could not start (claim not reserved yet, driver not registered...)."""
        for uid in list(self._retry):
            pod = self.pods.get(uid)
            if pod is None:
                self._retry.discard(uid)
                continue
            meta = pod["metadata"]
            try:
                fresh = decode(await request(self.api, "GET", PODS.path(meta["namespace"], meta["name"])))
            except ApiError as exc:
                # 403: the Node authorizer lets a node read only the pods bound to it, so a pod deleted (or
                # recreated elsewhere) meanwhile is refused rather than not found, as a real kubelet sees it
                if exc.status in (403, 404):
                    await self.forget_pod(uid)
                continue
            except (TimeoutError, OSError, aiohttp.ClientError):
                continue  # API server away; the next round tries again
            await self.sync_pod(fresh, force=True)

    async def _retry_loop(self, stopping: asyncio.Event, wake: asyncio.Event | None) -> None:
        backoff = Backoff(initial_s=RETRY_MIN, cap_s=RETRY_MAX)
        delay = backoff.next()
        while not stopping.is_set():
            waits = [asyncio.ensure_future(stopping.wait())]
            if wake is not None:
                waits.append(asyncio.ensure_future(wake.wait()))
            await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if wake is not None and wake.is_set():
                wake.clear()
                delay = backoff.restart()
            if self._retry or self.claims.orphans():
                try:
                    await self.retry_pending()
                    if self.claims.orphans():  # claims whose unprepare failed (driver not back yet...)
                        async with self._lock:
                            await self._release_pod("")
                except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - a dead retry loop leaves pods waiting
                    if isinstance(exc, asyncio.CancelledError) and cancelling():
                        raise  # we are stopped; any other CancelledError came from a callee (a closed channel...)
                    log.error(
                        "retrying waiting pods failed; the next round tries again",
                        node=self.node,
                        error=f"{type(exc).__name__}: {exc}",
                        waiting=len(self._retry),
                    )
                delay = backoff.next() if self._retry or self.claims.orphans() else backoff.restart()

    # ------------------------------------------------------------------ watch loop
    async def run(self, stopping: asyncio.Event, wake: asyncio.Event | None = None) -> None:
        """List+watch this node's pods until `stopping`; `wake` (plugins changed) retries waiting pods."""
        retry = asyncio.create_task(self._retry_loop(stopping, wake))
        loop = asyncio.create_task(self._list_and_watch(stopping))
        stop = asyncio.create_task(stopping.wait())
        try:
            await asyncio.wait([retry, loop, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (retry, loop, stop):
                task.cancel()
            results = await asyncio.gather(retry, loop, stop, return_exceptions=True)
            await cancel_and_wait([*self._events, *self._health_writes])
            await self.stop_all()
        for result in results:
            if isinstance(result, Exception):
                raise result
        if not stopping.is_set():  # the loops end only when stopped: say so rather than leave pods waiting
            raise RuntimeError(f"the pod loops of node {self.node} ended before it was stopped: {results[:2]!r}")

    async def _list_and_watch(self, stopping: asyncio.Event) -> None:
        await watch_node_pods(
            self.api, self.node, self.resync_seconds, stopping, on_list=self._listed, on_event=self._spawn_event
        )

    async def _listed(self, pods: list[dict[str, Any]]) -> None:
        await self.prune({pod["metadata"]["uid"] for pod in pods})
        for pod in pods:
            await self.sync_pod(pod)

    def _spawn_event(self, kind: str, pod: dict[str, Any]) -> None:
        task = asyncio.create_task(self._handle_event(kind, pod))
        self._events.add(task)
        task.add_done_callback(self._events.discard)

    async def _handle_event(self, kind: str, pod: dict[str, Any]) -> None:
        """One watch event in its own task: pods are prepared side by side, and each pod's events are handled
        in the order they came (its lock is taken first, and asyncio's locks are fair)."""
        uid = pod["metadata"]["uid"]
        try:
            if kind == "DELETED":
                await self.forget_pod(uid)
            else:
                await self.sync_pod(pod)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - the retry loop takes the pod up again
            if isinstance(exc, asyncio.CancelledError) and cancelling():
                raise
            log.error(
                "pod event not handled; retrying",
                node=self.node,
                pod=pod["metadata"].get("name"),
                error=f"{type(exc).__name__}: {exc}",
            )
            if kind != "DELETED":
                self._retry.add(uid)
