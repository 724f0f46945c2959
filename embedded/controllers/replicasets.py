"""The ReplicaSet controller, and the pod and status helpers the Deployment and Job controllers share.

Owns a ReplicaSet's pods: those whose controller ownerReference carries the ReplicaSet's uid
(nothing else is adopted or touched). It keeps `spec.replicas` of them active (not deleting, not
Succeeded/Failed): it creates `<rs>-<random5>` pods from the template (in slow-start batches
1, 2, 4, ...) and deletes extras, unscheduled/pending/not-ready/newest first. A pod deleted or
finished is replaced. It writes status (replicas, fullyLabeledReplicas, readyReplicas,
availableReplicas, observedGeneration) through the `/status` subresource with the
resourceVersion it read, re-reading on 409. A ReplicaSet being deleted is left to the API
server's garbage collector.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
from collections.abc import Callable

from shared.kube.informer import Informer, Obj, key_of, uid_of
from shared.kube.resources import EVENTS, PODS, REPLICASETS, Kube, Resource
from shared.kube.rest import ApiError
from shared.kube.timestamps import k8s_time
from shared.logs import get_logger
from shared.telemetry import get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)
DONE_PHASES = ("Succeeded", "Failed")
STATUS_WRITE_TRIES = 5


# ---- helpers shared by the controllers -------------------------------------------------------------


def now_iso() -> str:
    return k8s_time()


def parse_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None


def is_active(pod: Obj) -> bool:
    """Counts towards replicas: not being deleted and not finished."""
    return not (pod.get("metadata") or {}).get("deletionTimestamp") and (
        (pod.get("status") or {}).get("phase") not in DONE_PHASES
    )


def ready_condition(pod: Obj) -> Obj | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return dict(cond)
    return None


def is_ready(pod: Obj) -> bool:
    return (ready_condition(pod) or {}).get("status") == "True"


def available_in(pod: Obj, min_ready_seconds: int) -> float | None:
    """0 if the pod is available (ready for minReadySeconds), the seconds until it is, or None if not ready."""
    if not is_ready(pod):
        return None
    if min_ready_seconds <= 0:
        return 0.0
    since = parse_time((ready_condition(pod) or {}).get("lastTransitionTime"))
    if since is None:
        return 0.0
    left = (since + dt.timedelta(seconds=min_ready_seconds) - dt.datetime.now(dt.UTC)).total_seconds()
    return max(0.0, left)


def owner_ref(owner: Obj, api_version: str, kind: str) -> Obj:
    md = owner["metadata"]
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": md["name"],
        "uid": md["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def pod_from_template(
    template: Obj, namespace: str, generate_name: str, owner: Obj, labels: dict[str, str] | None = None
) -> Obj:
    """A Pod body from a pod template: its labels (plus `labels`), annotations and spec, owned by `owner`."""
    tmd = template.get("metadata") or {}
    md: Obj = {
        "generateName": generate_name,
        "namespace": namespace,
        "labels": {**(tmd.get("labels") or {}), **(labels or {})},
        "ownerReferences": [owner],
    }
    if tmd.get("annotations"):
        md["annotations"] = dict(tmd["annotations"])
    if tmd.get("finalizers"):
        md["finalizers"] = list(tmd["finalizers"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": md, "spec": copy.deepcopy(template.get("spec") or {})}


def delete_order(pods: list[Obj]) -> list[Obj]:
    """Pods in the order to delete them: unscheduled, pending, not ready, and newest first."""
    phase_rank = {"Pending": 0, "Unknown": 1, "Running": 2}
    newest = sorted(pods, key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp") or ""), reverse=True)
    return sorted(
        newest,
        key=lambda p: (
            bool((p.get("spec") or {}).get("nodeName")),
            phase_rank.get(str((p.get("status") or {}).get("phase")), 0),
            is_ready(p),
        ),
    )


async def create_pods(kube: Kube, pods: Informer, namespace: str, count: int, body: Callable[[], Obj]) -> int:
    """Create `count` pods in slow-start batches (1, 2, 4, ...), stopping at a failing batch; how many were made."""
    made, batch = 0, 1
    while made < count:
        size = min(batch, count - made)
        results = await asyncio.gather(
            *(kube.create(PODS, namespace, body()) for _ in range(size)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, dict):
                pods.apply(r, "ADDED")
                made += 1
        if errors:
            raise errors[0]
        batch *= 2
    return made


async def delete_pods(kube: Kube, pods: Informer, victims: list[Obj]) -> None:
    async def one(pod: Obj) -> None:
        ns, name = key_of(pod)
        await kube.delete(PODS, ns, name, uid=uid_of(pod))
        pods.mark_deleted(pod)

    results = await asyncio.gather(*(one(p) for p in victims), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]


async def write_status(kube: Kube, res: Resource, cache: Informer, obj: Obj, status: Obj) -> bool:
    """PUT `status` to obj's /status with the resourceVersion read (re-reading on 409); False if unchanged."""
    current = obj
    for attempt in range(STATUS_WRITE_TRIES):
        if (current.get("status") or {}) == status:
            return False
        try:
            updated = await kube.replace(res, {**current, "status": status}, subresource="status")
        except ApiError as exc:
            if not exc.conflict or attempt == STATUS_WRITE_TRIES - 1:
                raise
            current = await kube.get(res, *key_of(obj))
            if uid_of(current) != uid_of(obj):
                return False
            continue
        cache.apply(updated)
        return True
    return False


def set_condition(
    conditions: list[Obj], kind: str, status: str, reason: str, message: str, probe: bool = False, update: bool = False
) -> list[Obj]:
    """conditions with `kind` set; timestamps kept while nothing about it changes."""
    now = now_iso()
    old = next((c for c in conditions if c.get("type") == kind), None)
    cond: Obj = {"type": kind, "status": status, "reason": reason, "message": message}
    if old is not None and all(old.get(k) == cond[k] for k in ("status", "reason", "message")):
        return conditions
    stamp_keys = (["lastProbeTime"] if probe else []) + (["lastUpdateTime"] if update else [])
    for k in stamp_keys:
        cond[k] = now
    same_status = old is not None and old.get("status") == status
    cond["lastTransitionTime"] = (old or {}).get("lastTransitionTime", now) if same_status else now
    if old is None:
        return [*conditions, cond]
    return [cond if c is old else c for c in conditions]


def condition_true(obj: Obj, kind: str) -> bool:
    return any(
        c.get("type") == kind and c.get("status") == "True" for c in (obj.get("status") or {}).get("conditions") or []
    )


async def record_event(kube: Kube, obj: Obj, component: str, reason: str, message: str, warning: bool = False) -> None:
    """A core/v1 Event about obj; best effort, as upstream's recorder."""
    ns, name = key_of(obj)
    now = now_iso()
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{name}.", "namespace": ns},
        "involvedObject": {
            "apiVersion": obj.get("apiVersion", ""),
            "kind": obj.get("kind", ""),
            "namespace": ns,
            "name": name,
            "uid": uid_of(obj),
        },
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        await kube.create(EVENTS, ns, body)
    except ApiError as exc:
        log.warning("could not record event", object=f"{ns}/{name}", reason=reason, error=str(exc))


def compact(status: Obj, keep: tuple[str, ...] = ()) -> Obj:
    """status without zero/empty fields (as upstream's omitempty), except those in `keep`."""
    return {k: v for k, v in status.items() if k in keep or v not in (0, None, [], {})}


# ---- the ReplicaSet controller ---------------------------------------------------------------------


class ReplicaSetController:
    component = "replicaset-controller"

    def __init__(self, kube: Kube, replicasets: Informer, pods: Informer) -> None:
        self.kube = kube
        self.replicasets = replicasets
        self.pods = pods

    def pods_of(self, rs: Obj) -> list[Obj]:
        ns = key_of(rs)[0]
        return [p for p in self.pods.owned_by(uid_of(rs)) if key_of(p)[0] == ns]

    async def reconcile(self, namespace: str, name: str) -> float | None:
        rs = self.replicasets.get(namespace, name)
        if rs is None or (rs.get("metadata") or {}).get("deletionTimestamp"):
            return None
        with tracer.start_as_current_span(
            "controllers.reconcile_replicaset",
            attributes={"k8s.namespace.name": namespace, "k8s.replicaset.name": name},
        ) as span:
            spec = rs.get("spec") or {}
            want = 1 if spec.get("replicas") is None else int(spec["replicas"])
            active = [p for p in self.pods_of(rs) if is_active(p)]
            span.set_attribute("gpu_dra.replicas.want", want)
            span.set_attribute("gpu_dra.replicas.active", len(active))
            if len(active) < want:
                ref = owner_ref(rs, "apps/v1", "ReplicaSet")
                template = spec.get("template") or {}
                made = 0
                try:
                    made = await create_pods(
                        self.kube,
                        self.pods,
                        namespace,
                        want - len(active),
                        lambda: pod_from_template(template, namespace, f"{name}-", ref),
                    )
                finally:
                    if made:
                        log.info("pods created", replicaset=f"{namespace}/{name}", count=made, want=want)
                        await record_event(
                            self.kube,
                            rs,
                            self.component,
                            "SuccessfulCreate",
                            f"Created {made} pod(s) for ReplicaSet {name}",
                        )
            elif len(active) > want:
                victims = delete_order(active)[: len(active) - want]
                await delete_pods(self.kube, self.pods, victims)
                log.info("pods deleted", replicaset=f"{namespace}/{name}", count=len(victims), want=want)
                await record_event(
                    self.kube,
                    rs,
                    self.component,
                    "SuccessfulDelete",
                    "Deleted pod(s): " + ", ".join(key_of(p)[1] for p in victims),
                )
            return await self.update_status(namespace, name)

    async def update_status(self, namespace: str, name: str) -> float | None:
        rs = self.replicasets.get(namespace, name)
        if rs is None:
            return None
        spec = rs.get("spec") or {}
        min_ready = int(spec.get("minReadySeconds") or 0)
        active = [p for p in self.pods_of(rs) if is_active(p)]
        selector = (spec.get("selector") or {}).get("matchLabels") or {}
        template_labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        waits = [available_in(p, min_ready) for p in active]
        status = compact(
            {
                "replicas": len(active),
                "fullyLabeledReplicas": sum(
                    1
                    for p in active
                    if all(
                        ((p.get("metadata") or {}).get("labels") or {}).get(k) == v
                        for k, v in {**template_labels, **selector}.items()
                    )
                ),
                "readyReplicas": sum(1 for p in active if is_ready(p)),
                "availableReplicas": sum(1 for w in waits if w == 0),
                "observedGeneration": (rs.get("metadata") or {}).get("generation"),
                "conditions": (rs.get("status") or {}).get("conditions"),
            },
            keep=("replicas",),
        )
        await write_status(self.kube, REPLICASETS, self.replicasets, rs, status)
        pending = [w for w in waits if w]
        return min(pending) + 0.05 if pending else None
