"""The controllers' wiring: four informers, one work queue, a few workers, the resync backstop.

Owns which change wakes which owner: a pod wakes its controller (ReplicaSet or Job), a
ReplicaSet wakes itself and its Deployment, a Deployment or a Job wakes itself. Keys are
`(plural, namespace, name)`; the queue holds each key once and never hands the same key to two
workers at a time (client-go's workqueue semantics). A reconcile that fails is retried with an
exponential backoff; one that asks for it (a deadline, minReadySeconds) is re-queued after the
delay it returns. Workers start only after every informer has listed once, so that no reconcile
acts on a partial view. Every `resync_seconds` every owner is queued again (the backstop).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient

from embedded.controllers.deployments import DeploymentController
from embedded.controllers.jobs import JobController
from embedded.controllers.replicasets import ReplicaSetController
from shared.kube.informer import Informer, Obj, controller_of, key_of, until_synced
from shared.kube.resources import DEPLOYMENTS, JOBS, PODS, REPLICASETS, Kube
from shared.kube.rest import ApiError
from shared.logs import get_logger
from shared.workqueue import WorkQueue

log = get_logger(__name__)
QueueKey = tuple[str, str, str]
Reconcile = Callable[[str, str], Awaitable[float | None]]
TRANSIENT = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class Controllers:
    """`await Controllers(api_client).run(stopping)` runs the Deployment, ReplicaSet and Job controllers."""

    def __init__(
        self, api_client: ApiClient, resync_seconds: float = 30.0, workers: int = 4, watch_timeout_s: int = 300
    ) -> None:
        self.kube = Kube(api_client)
        self.queue: WorkQueue[QueueKey] = WorkQueue()
        self.resync_seconds = resync_seconds
        self.workers = workers
        self.pods = Informer(self.kube, PODS, self._on_pod, watch_timeout_s)
        self.replicasets = Informer(self.kube, REPLICASETS, self._on_replicaset, watch_timeout_s)
        self.deployments = Informer(self.kube, DEPLOYMENTS, self._on_self(DEPLOYMENTS.plural), watch_timeout_s)
        self.jobs = Informer(self.kube, JOBS, self._on_self(JOBS.plural), watch_timeout_s)
        self.informers = (self.pods, self.replicasets, self.deployments, self.jobs)
        self.rs = ReplicaSetController(self.kube, self.replicasets, self.pods)
        self.deploy = DeploymentController(self.kube, self.deployments, self.replicasets, self.pods)
        self.job = JobController(self.kube, self.jobs, self.pods)
        self.reconcilers: dict[str, Reconcile] = {
            REPLICASETS.plural: self.rs.reconcile,
            DEPLOYMENTS.plural: self.deploy.reconcile,
            JOBS.plural: self.job.reconcile,
        }
        self.ready = asyncio.Event()  # every informer listed; workers running
        self.reconciles = 0

    # ---- what wakes whom ---------------------------------------------------------------------------

    def _wake_controller(self, obj: Obj | None, kinds: dict[str, str]) -> None:
        ref = controller_of(obj)
        if ref is None or obj is None:
            return
        group = str(ref.get("apiVersion") or "").partition("/")[0]
        plural = kinds.get(f"{group}/{ref.get('kind')}")
        if plural:
            self.queue.add((plural, key_of(obj)[0], str(ref.get("name") or "")))

    def _on_pod(self, event: str, obj: Obj, old: Obj | None) -> None:
        kinds = {"apps/ReplicaSet": REPLICASETS.plural, "batch/Job": JOBS.plural}
        for pod in (obj, old) if old is not None and controller_of(old) != controller_of(obj) else (obj,):
            self._wake_controller(pod, kinds)
            ref = controller_of(pod)
            if ref and ref.get("kind") == "ReplicaSet":
                # A Deployment waits for old pods to be gone (Recreate), which its ReplicaSet's
                # status may not show: wake the Deployment too.
                rs = self.replicasets.get(key_of(pod)[0], str(ref.get("name") or ""))
                self._wake_controller(rs, {"apps/Deployment": DEPLOYMENTS.plural})

    def _on_replicaset(self, event: str, obj: Obj, old: Obj | None) -> None:
        self.queue.add((REPLICASETS.plural, *key_of(obj)))
        kinds = {"apps/Deployment": DEPLOYMENTS.plural}
        self._wake_controller(obj, kinds)
        if old is not None and controller_of(old) != controller_of(obj):
            self._wake_controller(old, kinds)

    def _on_self(self, plural: str) -> Callable[[str, Obj, Obj | None], None]:
        def handler(event: str, obj: Obj, old: Obj | None) -> None:
            self.queue.add((plural, *key_of(obj)))

        return handler

    def resync(self) -> None:
        for inf in (self.deployments, self.replicasets, self.jobs):
            for obj in inf.values():
                self.queue.add((inf.res.plural, *key_of(obj)))

    # ---- the loop ----------------------------------------------------------------------------------

    async def _work(self) -> None:
        while True:
            key, _ = await self.queue.get()
            plural, ns, name = key
            try:
                self.reconciles += 1
                again = await self.reconcilers[plural](ns, name)
                self.queue.backoffs.pop(key, None)
                if again is not None:
                    self.queue.add_after(key, again)
            except (ApiError, *TRANSIENT) as exc:
                delay = self.queue.retry(key)
                log.warning(
                    "reconcile failed; retrying", kind=plural, object=f"{ns}/{name}", error=str(exc), retry_s=delay
                )
            except Exception:
                delay = self.queue.retry(key)
                log.exception("reconcile crashed; retrying", kind=plural, object=f"{ns}/{name}", retry_s=delay)
            finally:
                self.queue.done(key)

    async def run(self, stopping: asyncio.Event) -> None:
        tasks: list[asyncio.Task[Any]] = [
            asyncio.create_task(i.run(stopping), name=f"inform-{i.res.plural}") for i in self.informers
        ]
        try:
            if not await until_synced((i.synced for i in self.informers), stopping):
                return
            tasks += [asyncio.create_task(self._work(), name=f"controller-worker-{n}") for n in range(self.workers)]
            self.ready.set()
            log.info(
                "controllers synced",
                deployments=len(self.deployments.objects),
                replicasets=len(self.replicasets.objects),
                jobs=len(self.jobs.objects),
                pods=len(self.pods.objects),
            )
            while not stopping.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopping.wait(), self.resync_seconds)
                self.resync()
        finally:
            self.queue.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
