"""Pods waiting for devices: the fleet page's pending-pods panel (docs/dashboard.md).

Owns one informer of the pods on no node (trimmed to what says whether one waits: resource claims, phase
Pending), the waiting pods, and the loop that asks a `Reasoner` (`gpu-dra explain`'s plan, `embedded.cluster.explain.
why_waiting`, where this install has it) what each one asks for and why it waits. A pod is explained when it
has waited `settle_s` (most pods are placed sooner: a burst of new pods costs no reads), then whenever it changes
and, while it waits, after the fleet changes; at most one pass every `recheck_s`, one pod at a time, so a storm
of changes costs the API server a bounded number of reads. Until then, and without a reasoner, the reason is the
scheduler's `PodScheduled=False` message.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from shared.kube.informer import Informer, key_of
from shared.kube.resources import PODS, Kube
from shared.logs import get_logger

log = get_logger(__name__)
Obj = dict[str, Any]
Key = tuple[str, str]
Reasoner = Callable[[str, str], Awaitable[tuple[str, str]]]  # (namespace, pod) -> (what it asks for, why it waits)
UNSCHEDULED = "spec.nodeName="  # the field selector of pods not bound to a node


class PendingPod(msgspec.Struct, frozen=True, rename="camel"):
    """One waiting pod as the page shows it; `since` is its creation time."""

    namespace: str
    pod: str
    since: str
    asks: str = ""
    reason: str = ""


def trim_pod(pod: Obj) -> Obj:
    md, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    scheduled = [c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"]
    return {
        "metadata": {
            k: md[k]
            for k in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp", "resourceVersion")
            if k in md
        },
        "spec": {"nodeName": spec.get("nodeName") or "", "resourceClaims": spec.get("resourceClaims") or []},
        "status": {"phase": status.get("phase") or "Pending", "conditions": scheduled},
    }


def waits(pod: Obj) -> bool:
    """Not on a node yet, asks for resource claims, and neither finished nor going away."""
    spec, md = pod.get("spec") or {}, pod.get("metadata") or {}
    return (
        not spec.get("nodeName")
        and bool(spec.get("resourceClaims"))
        and not md.get("deletionTimestamp")
        and (pod.get("status") or {}).get("phase", "Pending") == "Pending"
    )


def _age_s(created: str) -> float:
    """Seconds a pod has surely existed, from its creationTimestamp (whole seconds: up to one less than its
    age; 0 when there is none or it does not parse)."""
    try:
        return max(0.0, time.time() - dt.datetime.fromisoformat(created).timestamp() - 1.0)
    except ValueError:
        return 0.0


def scheduler_message(pod: Obj) -> str:
    cond = next(iter((pod.get("status") or {}).get("conditions") or []), None)
    return str(cond.get("message") or cond.get("reason") or "") if cond and cond.get("status") == "False" else ""


class PendingPods:
    """The waiting pods; `on_change()` is called whenever the list or a reason changes."""

    def __init__(
        self,
        kube: Kube,
        reasoner: Reasoner | None,
        on_change: Callable[[], None],
        recheck_s: float = 2.0,
        settle_s: float = 1.0,
    ) -> None:
        self.reasoner = reasoner
        self.on_change = on_change
        self.recheck_s = recheck_s
        self.settle_s = settle_s
        # Only pods on no node: a pod leaves the watch (DELETED) when it is bound, so the page is sent none of the
        # status writes of the fleet's running pods.
        self.informer = Informer(kube, PODS, on_change=self._on_pod, transform=trim_pod, field_selector=UNSCHEDULED)
        self.pods: dict[Key, PendingPod] = {}
        self._due: set[Key] = set()
        self._wake = asyncio.Event()
        self._settling: dict[Key, asyncio.TimerHandle] = {}  # waiting pods not waiting for `settle_s` yet

    def view(self, sees: Callable[[str], bool]) -> list[PendingPod]:
        """The waiting pods of the namespaces `sees` admits, oldest first."""
        return sorted((p for p in self.pods.values() if sees(p.namespace)), key=lambda p: (p.since, p.namespace, p.pod))

    def _on_pod(self, event: str, obj: Obj, old: Obj | None) -> None:
        key = key_of(obj)
        if event != "DELETED" and waits(obj):
            before = self.pods.get(key)
            reason = before.reason if before is not None and self.reasoner is not None else scheduler_message(obj)
            now = PendingPod(
                namespace=key[0],
                pod=key[1],
                since=str(obj["metadata"].get("creationTimestamp") or ""),
                asks=before.asks if before is not None else "",
                reason=reason,
            )
            if now != before:
                self.pods[key] = now
                self.on_change()
            wait = self.settle_s - _age_s(now.since) if before is None else 0.0
            if wait > 0:
                self._settling[key] = asyncio.get_running_loop().call_later(wait, self._settled, key)
            elif key not in self._settling:
                self._explain({key})
        else:
            timer = self._settling.pop(key, None)
            if timer is not None:
                timer.cancel()
            if self.pods.pop(key, None) is not None:
                self.on_change()

    def _settled(self, key: Key) -> None:
        self._settling.pop(key, None)
        self._explain({key})

    def fleet_changed(self) -> None:
        """Devices were allocated, freed, published or tainted: every waiting pod's reason may have changed."""
        self._explain(set(self.pods) - set(self._settling))

    def _explain(self, keys: set[Key]) -> None:
        if self.reasoner is not None and keys:
            self._due |= keys
            self._wake.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Explain the due pods until `stopping`: a pass over those due, then at least `recheck_s` to the next."""
        if self.reasoner is None:
            return
        stop = asyncio.create_task(stopping.wait())
        try:
            while not stopping.is_set():
                wake = asyncio.create_task(self._wake.wait())
                await asyncio.wait({wake, stop}, return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                if stopping.is_set():
                    return
                self._wake.clear()
                due, self._due = self._due, set()
                for key in sorted(due):
                    await self._reason(key)
                with contextlib.suppress(TimeoutError):  # the bound on the rate, not a wait for an event
                    await asyncio.wait_for(asyncio.shield(stop), self.recheck_s)
        finally:
            stop.cancel()

    async def _reason(self, key: Key) -> None:
        assert self.reasoner is not None
        if key not in self.pods:
            return
        try:
            asks, reason = await self.reasoner(*key)
        except Exception as exc:  # one pod's explain failing must not stop the others'
            log.warning("cannot explain a waiting pod", pod=f"{key[0]}/{key[1]}", error=str(exc))
            return
        current = self.pods.get(key)
        if current is not None and (current.asks, current.reason) != (asks, reason):
            self.pods[key] = msgspec.structs.replace(current, asks=asks, reason=reason)
            self.on_change()
