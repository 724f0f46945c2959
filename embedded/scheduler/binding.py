"""The scheduler's writes: claim allocation + reservedFor, pod binding, PodScheduled, Events, deallocation.

Owns the write side of a Plan. Claim status goes through `resourceclaims/status` PUT with the
cached resourceVersion (a 409 means the cache was behind: the fresh claim is cached and the pod is
tried again). The writes are assumed in the ClusterState when decided (`reservation`), so the next
decision sees the devices as taken while they are on their way (the loop sends a pod's writes while
it decides the next pods); each answer replaces its assumption, and a failed write puts the claim
back as it was. Binding goes through `pods/binding`, after the pod's claim writes; the pod is cached
as bound from the decision on, and unbound again if a write fails.

Each claim the scheduler allocates starts that claim's trace (a root span `scheduler.allocate_claim`,
linked to the pod's scheduling span): its W3C context goes on the claim as the annotation
`gpu.nvidia.com/traceparent` for the preparer to continue. The status subresource leaves metadata
alone (as upstream's), so the annotation is a PUT of the claim with the cached resourceVersion just
before the allocation's status PUT, and only when tracing is on (no-op tracer: no context, no write).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from embedded.scheduler.plan import MAX_RESERVED, Plan, reserved_for_pod
from embedded.scheduler.state import ClusterState
from shared.kube.informer import key_of
from shared.kube.resources import EVENTS, PODS, RESOURCECLAIMS, Kube
from shared.kube.rest import ApiError
from shared.kube.timestamps import k8s_time
from shared.logs import get_logger
from shared.telemetry import CLAIM_TRACEPARENT_ANNOTATION, current_traceparent, get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)
Obj = dict[str, Any]
SCHEDULER_NAME = "default-scheduler"
DONE_PHASES = ("Succeeded", "Failed")


class Conflict(Exception):
    """A claim changed under us; the pod is tried again with the fresh claim."""


@dataclass
class ClaimWrite:
    """One claim status write of a reservation: the cached claim it is based on, the claim as it will be
    written, and the allocation it adds (None: only reservedFor changes)."""

    original: Obj
    claim: Obj
    allocation: Obj | None


class Writer:
    def __init__(self, kube: Kube, state: ClusterState) -> None:
        self.kube = kube
        self.state = state

    async def _write_claim_status(self, claim: Obj) -> Obj:
        """PUT a claim's status (a 409: Conflict, the fresh claim cached)."""
        return await self._write_claim(claim, subresource="status")

    def reservation(self, plan: Plan, pod: Obj) -> list[ClaimWrite]:
        """The claim writes that allocate the plan's new claims and reserve every claim of the pod for it,
        assumed in the cache at once (the next decision sees their devices taken); `reserve` sends them."""
        md = pod["metadata"]
        consumer = {"resource": "pods", "name": md["name"], "uid": md["uid"]}
        writes: list[ClaimWrite] = []
        for key in plan.claims:
            ns, name = key.split("/", 1)
            cached = self.state.get(RESOURCECLAIMS, ns, name)
            if cached is None:
                raise Conflict(f"claim {key} disappeared")
            status = cached.get("status") or {}
            allocation = plan.allocations.get(key)
            if allocation is None and not status.get("allocation"):
                raise Conflict(f"claim {key} was deallocated meanwhile")
            if allocation is not None and status.get("allocation"):
                raise Conflict(f"claim {key} was allocated meanwhile")
            if allocation is None and reserved_for_pod(cached, md["uid"]):
                continue
            claim = copy.deepcopy(cached)
            new_status = claim.setdefault("status", {})
            if allocation is not None:
                new_status["allocation"] = allocation
            reserved = [r for r in new_status.get("reservedFor") or [] if r.get("uid") != md["uid"]]
            if len(reserved) >= MAX_RESERVED:
                raise Conflict(f"claim {key} is already reserved for {MAX_RESERVED} consumers")
            new_status["reservedFor"] = [*reserved, consumer]
            writes.append(ClaimWrite(cached, claim, allocation))
        for write in writes:
            self.state.assume(write.claim)
        return writes

    async def reserve(self, writes: list[ClaimWrite], pod: Obj) -> None:
        """Send a `reservation`'s writes in order; when one fails, the claims not written are cached as they were
        (Conflict: the fresh claim is cached)."""
        sent = 0
        try:
            for write in writes:
                if write.allocation is None:
                    await self._write_claim_status(write.claim)
                else:
                    await self._allocate(write.claim, write.allocation, pod)
                sent += 1
        finally:
            for write in writes[sent:]:
                self.state.forget(write.original)

    async def _allocate(self, claim: Obj, allocation: Obj, pod: Obj) -> None:
        """Write a new allocation in the claim's own trace (module doc)."""
        md = claim["metadata"]
        results = (allocation.get("devices") or {}).get("results") or []
        pod_span = trace.get_current_span().get_span_context()
        with tracer.start_as_current_span(
            "scheduler.allocate_claim",
            context=otel_context.Context(),
            links=[trace.Link(pod_span)] if pod_span.is_valid else None,
            attributes={
                "dra.claim.uid": md.get("uid", ""),
                "dra.claim.name": md.get("name", ""),
                "k8s.namespace.name": md.get("namespace", ""),
                "k8s.pod.uid": pod["metadata"].get("uid", ""),
                "k8s.pod.name": pod["metadata"].get("name", ""),
                "dra.device": [f"{r.get('pool')}/{r.get('device')}" for r in results],
                "dra.driver": sorted({str(r.get("driver", "")) for r in results}),
            },
        ):
            traceparent = current_traceparent()
            if traceparent and (md.get("annotations") or {}).get(CLAIM_TRACEPARENT_ANNOTATION) != traceparent:
                annotated = copy.deepcopy(claim)
                annotated["metadata"].setdefault("annotations", {})[CLAIM_TRACEPARENT_ANNOTATION] = traceparent
                annotated.pop("status", None)
                written = await self._write_claim(annotated)
                claim["metadata"] = written["metadata"]
                self.state.assume(claim)  # still to be written: based on the annotated version now
            await self._write_claim_status(claim)

    async def _write_claim(self, claim: Obj, subresource: str | None = None) -> Obj:
        """PUT a claim's metadata/spec (or `subresource`) with its resourceVersion (a 409: Conflict, the
        fresh claim cached)."""
        try:
            written = await self.kube.replace(RESOURCECLAIMS, claim, subresource=subresource)
        except ApiError as exc:
            if not exc.conflict and not exc.not_found:
                raise
            await self._refresh(claim)
            ns, name = key_of(claim)
            raise Conflict(f"claim {ns}/{name} changed while it was written ({exc.reason})") from exc
        self.state.apply(RESOURCECLAIMS, "MODIFIED", written)
        return written

    async def _refresh(self, claim: Obj) -> None:
        ns, name = key_of(claim)
        try:
            fresh = await self.kube.get(RESOURCECLAIMS, ns, name)
            self.state.apply(RESOURCECLAIMS, "MODIFIED", fresh)
        except ApiError as again:
            if not again.not_found:
                raise
            self.state.apply(RESOURCECLAIMS, "DELETED", claim)

    def assume_bound(self, pod: Obj, node: str) -> None:
        """Cache the pod as bound to `node` before the binding is written (the next decisions count it
        there, and no pass tries it again); `bind` undoes this when the write fails."""
        bound = copy.deepcopy(pod)
        bound.setdefault("spec", {})["nodeName"] = node
        self.state.apply(PODS, "MODIFIED", bound)  # the watch brings the server's version right after

    def unbind(self, pod: Obj) -> None:
        """Undo `assume_bound` (the claims could not be reserved): the pod is cached as it was."""
        self.state.apply(PODS, "MODIFIED", pod)  # ignored when the watch brought a newer pod meanwhile

    async def bind(self, pod: Obj, node: str) -> None:
        """Write the binding of a pod `assume_bound` cached; on failure the cache has the pod unbound again."""
        ns, name = key_of(pod)
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": ns},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        try:
            await self.kube.create_subresource(PODS, ns, name, "binding", body)
        except BaseException:
            self.unbind(pod)
            raise
        current = self.state.get(PODS, ns, name)
        if (
            current is not None
            and current["metadata"].get("uid") == pod["metadata"].get("uid")
            and not (current.get("spec") or {}).get("nodeName")
        ):
            self.assume_bound(current, node)  # a newer version came meanwhile, from before the binding: it is bound

    async def mark_unschedulable(self, pod: Obj, message: str) -> bool:
        """PodScheduled=False (Unschedulable) with `message`; False when it already says exactly that."""
        ns, name = key_of(pod)
        conditions = list((pod.get("status") or {}).get("conditions") or [])
        old = next((c for c in conditions if c.get("type") == "PodScheduled"), None)
        if (
            old
            and old.get("status") == "False"
            and old.get("reason") == "Unschedulable"
            and old.get("message") == message
        ):
            return False
        cond = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastProbeTime": None,
            "lastTransitionTime": old.get("lastTransitionTime") if old and old.get("status") == "False" else k8s_time(),
        }
        conditions = [c for c in conditions if c.get("type") != "PodScheduled"] + [cond]
        updated = await self.kube.patch(PODS, ns, name, {"status": {"conditions": conditions}}, subresource="status")
        self.state.apply(PODS, "MODIFIED", updated)
        return True

    async def event(self, pod: Obj, reason: str, message: str, warning: bool = False) -> None:
        ns, name = key_of(pod)
        now = k8s_time()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": ns},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": ns,
                "name": name,
                "uid": pod["metadata"].get("uid", ""),
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": SCHEDULER_NAME},
            "reportingComponent": SCHEDULER_NAME,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.kube.create(EVENTS, ns, body)
        except ApiError as exc:  # events are best effort, as upstream's recorder
            log.warning("could not record event", pod=f"{ns}/{name}", reason=reason, error=str(exc))

    async def release(self) -> bool:
        """Drop consumers that are gone or done from every claim; free claims nobody uses. True if any write."""
        pods = {(p.get("metadata") or {}).get("uid"): p for p in self.state.values(PODS)}
        wrote = False
        for claim in self.state.values(RESOURCECLAIMS):
            status = claim.get("status") or {}
            reserved = status.get("reservedFor") or []
            keep = [
                r
                for r in reserved
                if r.get("resource") != "pods"
                or (r.get("uid") in pods and (pods[r["uid"]].get("status") or {}).get("phase") not in DONE_PHASES)
            ]
            if len(keep) == len(reserved) and (keep or not status.get("allocation")):
                continue
            if _collected(claim, pods):
                continue  # the garbage collector deletes it (its DELETED event frees its devices): no write
            updated = copy.deepcopy(claim)
            new_status = updated.setdefault("status", {})
            if keep:
                new_status["reservedFor"] = keep
            else:
                new_status.pop("reservedFor", None)
                new_status.pop("allocation", None)
                new_status.pop("devices", None)
            try:
                await self._write_claim_status(updated)
            except Conflict:
                continue  # the fresh claim is cached; the next pass looks again
            wrote = True
            log.info(
                "released claim" if not keep else "removed finished consumers from claim",
                claim=f"{key_of(claim)[0]}/{key_of(claim)[1]}",
                consumers=len(keep),
            )
        return wrote


def _collected(claim: Obj, pods: dict[Any, Obj]) -> bool:
    """Whether the garbage collector deletes the claim: every owner is a pod that is gone (the generated claim
    of a deleted pod). Releasing it first would be a write that races the deletion (a 404 and a GET, half the
    time, in a wave of deletes)."""
    owners = (claim.get("metadata") or {}).get("ownerReferences") or []
    return bool(owners) and all(o.get("kind") == "Pod" and o.get("uid") not in pods for o in owners)
