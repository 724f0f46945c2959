"""Leader election through a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it.

Owns the Lease record: a candidate creates it or takes it over once the holder has not renewed it
for `lease_duration` (measured on the candidate's own clock from when it last saw the record
change, so clock skew between nodes does not matter); updates are compare-and-set through the
resourceVersion, so only one candidate wins. The leader renews every `retry_period`; if it cannot
renew within `renew_deadline` it stops leading. On a clean stop it releases the Lease (empty
holder), so a standby takes over at its next attempt instead of waiting out the duration.

Why not kubernetes-asyncio's `leaderelection` (LeaseLock), checked against its 36.x source: it never
releases the Lease (no release-on-cancel), so every rollout of the controller leaves it leaderless for
a full lease duration (15 s by default) where ours lets the next candidate lead at its first attempt (see
tests/computedomain/test_leader.py); it cannot be stopped by an event, only cancelled mid-request; and it
logs through the stdlib root logger rather than ours. Everything else here (the Lease's fields, compare-and-set by
resourceVersion) is client-go's protocol, which both implement.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio.client import ApiClient
from prometheus_client import Gauge

from shared.kube.resources import LEASES, Kube
from shared.kube.rest import ApiError
from shared.logs import get_logger

log = get_logger(__name__)
LEADER = Gauge("gpu_dra_leader", "1 while this process leads (holds the Lease)", ["lease"])


def _now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        api: ApiClient,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
    ) -> None:
        self.kube = Kube(api)
        self.namespace = namespace
        self.name = name
        self.identity = f"{identity}-{uuid.uuid4().hex[:8]}"
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.leading = asyncio.Event()
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self.transitions_seen = 0

    def _spec(self, transitions: int, acquire: str) -> dict[str, Any]:
        now = _now_micro()
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_duration)),
            "acquireTime": acquire or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    async def _try(self) -> bool:
        """One attempt to acquire or renew; True when we hold the Lease afterwards."""
        try:
            lease = await self.kube.get(LEASES, self.namespace, self.name)
        except ApiError as exc:
            if not exc.not_found:
                raise
            body = {"metadata": {"name": self.name, "namespace": self.namespace}, "spec": self._spec(0, "")}
            try:
                await self.kube.create(LEASES, self.namespace, body)
            except ApiError as create_exc:
                if create_exc.conflict:
                    return False
                raise
            return True
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        record = (holder, str(spec.get("renewTime") or ""))
        now = time.monotonic()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
        if holder and holder != self.identity and now < self._observed_at + duration:
            return False  # someone else holds it and has renewed recently
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if holder == self.identity else 1)
        acquire = str(spec.get("acquireTime") or "") if holder == self.identity else ""
        body = {
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "resourceVersion": lease["metadata"]["resourceVersion"],
            },
            "spec": self._spec(transitions, acquire),
        }
        try:
            await self.kube.replace(LEASES, body)
        except ApiError as exc:
            if exc.conflict:
                return False  # another candidate updated it first
            raise
        if holder != self.identity:
            self.transitions_seen = transitions
        return True

    async def _attempt(self) -> bool:
        try:
            return await self._try()
        except ApiError as exc:
            log.warning("lease attempt failed", lease=self.name, status=exc.status)
        except Exception as exc:  # noqa: BLE001 - the API server may be briefly unreachable
            log.warning("lease attempt failed", lease=self.name, error=str(exc) or type(exc).__name__)
        return False

    async def run(self, stopping: asyncio.Event, lead: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
        """Campaign until `stopping`; while leading, run `lead(lost)` (it must return when `lost` is set)."""
        while not stopping.is_set():
            if not await self._attempt():
                await _wait(stopping, self.retry_period)
                continue
            log.info("became leader", lease=f"{self.namespace}/{self.name}", identity=self.identity)
            self.leading.set()
            LEADER.labels(f"{self.namespace}/{self.name}").set(1)
            lost = asyncio.Event()
            work: asyncio.Future[None] = asyncio.ensure_future(lead(lost))
            renewer = asyncio.create_task(self._renew(stopping, lost))
            try:
                await asyncio.wait({work, renewer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.set()
                renewer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await renewer
                try:
                    await asyncio.wait_for(asyncio.shield(work), 10.0)
                except (TimeoutError, asyncio.CancelledError):
                    work.cancel()
                except Exception:  # noqa: BLE001 - reported below
                    log.exception("leader work failed")
                self.leading.clear()
                LEADER.labels(f"{self.namespace}/{self.name}").set(0)
            if stopping.is_set():
                await self.release()
                return
            log.warning("stopped leading", lease=self.name, identity=self.identity)
            await self.release()
            await _wait(stopping, self.retry_period)

    async def _renew(self, stopping: asyncio.Event, lost: asyncio.Event) -> None:
        last_ok = time.monotonic()
        while not stopping.is_set():
            await _wait(stopping, self.retry_period)
            if stopping.is_set():
                return
            if await self._attempt():
                last_ok = time.monotonic()
            elif time.monotonic() - last_ok > self.renew_deadline:
                lost.set()
                return

    async def release(self) -> None:
        """Give the Lease up if we hold it (a clean stop)."""
        with contextlib.suppress(Exception):
            lease = await self.kube.get(LEASES, self.namespace, self.name)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            body = {
                "metadata": {
                    "name": self.name,
                    "namespace": self.namespace,
                    "resourceVersion": lease["metadata"]["resourceVersion"],
                },
                "spec": {
                    "holderIdentity": "",
                    "leaseDurationSeconds": 1,
                    "renewTime": _now_micro(),
                    "leaseTransitions": spec.get("leaseTransitions") or 0,
                },
            }
            await self.kube.replace(LEASES, body)
            log.info("released leadership", lease=self.name, identity=self.identity)


async def _wait(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
