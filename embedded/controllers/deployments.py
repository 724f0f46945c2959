"""The Deployment controller: one ReplicaSet per pod template, the rollout between them, and status.

Owns the ReplicaSets whose controller ownerReference carries the Deployment's uid. The current
template's ReplicaSet is `<deployment>-<pod-template-hash>` (FNV-32a of the template and the
collision count, encoded as upstream's SafeEncodeString), labelled and selected by
`pod-template-hash`, annotated with its revision. Rollouts follow `spec.strategy`: Recreate scales
the old ReplicaSets to 0 and creates or scales the new one once their pods are gone;
RollingUpdate (the default) keeps within maxSurge/maxUnavailable, first scaling down unhealthy old
replicas. A paused Deployment is only reported on. Old ReplicaSets at 0 beyond
revisionHistoryLimit are deleted. Status (replicas, updated/ready/available/unavailable,
observedGeneration, Available and Progressing conditions) is counted from the pods and written
through `/status`. progressDeadlineSeconds is not enforced.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from embedded.controllers.replicasets import (
    DONE_PHASES,
    available_in,
    compact,
    is_active,
    is_ready,
    owner_ref,
    record_event,
    set_condition,
    write_status,
)
from shared.kube.informer import Informer, Obj, key_of, uid_of
from shared.kube.resources import DEPLOYMENTS, REPLICASETS, Kube
from shared.kube.rest import ApiError
from shared.logs import get_logger
from shared.numbers import decimal_int
from shared.telemetry import get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)
HASH_LABEL = "pod-template-hash"
REVISION = "deployment.kubernetes.io/revision"
DESIRED = "deployment.kubernetes.io/desired-replicas"
MAX_REPLICAS = "deployment.kubernetes.io/max-replicas"
_SAFE = "bcdfghjklmnpqrstvwxz2456789"


def template_hash(template: Obj, collision_count: int = 0) -> str:
    """FNV-32a of the template (canonical JSON) and the collision count, safe-encoded as upstream does."""
    data = json.dumps(template, sort_keys=True, separators=(",", ":")).encode()
    if collision_count:
        data += int(collision_count).to_bytes(4, "little")
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return "".join(_SAFE[ord(ch) % len(_SAFE)] for ch in str(h))


def without_hash(template: Obj) -> Obj:
    out = copy.deepcopy(template)
    labels = (out.get("metadata") or {}).get("labels")
    if isinstance(labels, dict):
        labels.pop(HASH_LABEL, None)
    return out


def replicas_of(obj: Obj) -> int:
    value = (obj.get("spec") or {}).get("replicas")
    return 1 if value is None else int(value)


def revision_of(rs: Obj) -> int:
    text = str(((rs.get("metadata") or {}).get("annotations") or {}).get(REVISION) or "0")
    return decimal_int(text) or 0


def _resolve(value: Any, total: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        scaled = float(value[:-1]) * total / 100
        return math.ceil(scaled) if round_up else math.floor(scaled)
    return int(value or 0)


def surge_and_unavailable(d: Obj) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) as numbers; (0, 0) for Recreate."""
    strategy = (d.get("spec") or {}).get("strategy") or {}
    if strategy.get("type") == "Recreate":
        return 0, 0
    rolling = strategy.get("rollingUpdate") or {}
    replicas = replicas_of(d)
    surge = _resolve(rolling.get("maxSurge", "25%"), replicas, round_up=True)
    unavailable = _resolve(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
    if surge == 0 and unavailable == 0:
        unavailable = 1  # as upstream: a rollout must be able to make progress
    return surge, min(unavailable, replicas)


class DeploymentController:
    component = "deployment-controller"

    def __init__(self, kube: Kube, deployments: Informer, replicasets: Informer, pods: Informer) -> None:
        self.kube = kube
        self.deployments = deployments
        self.replicasets = replicasets
        self.pods = pods

    # ---- views -------------------------------------------------------------------------------------

    def replicasets_of(self, d: Obj) -> list[Obj]:
        ns = key_of(d)[0]
        return [
            rs
            for rs in self.replicasets.owned_by(uid_of(d))
            if key_of(rs)[0] == ns and not (rs.get("metadata") or {}).get("deletionTimestamp")
        ]

    def split(self, d: Obj) -> tuple[Obj | None, list[Obj]]:
        """(the ReplicaSet of the current template or None, the others)."""
        template = (d.get("spec") or {}).get("template") or {}
        rss = self.replicasets_of(d)
        new = next((rs for rs in rss if without_hash((rs.get("spec") or {}).get("template") or {}) == template), None)
        if new is None:
            h = template_hash(template, int((d.get("status") or {}).get("collisionCount") or 0))
            new = next((rs for rs in rss if key_of(rs)[1] == f"{key_of(d)[1]}-{h}"), None)
        return new, [rs for rs in rss if rs is not new]

    def pod_counts(self, rs: Obj, min_ready: int) -> tuple[int, int, int]:
        """(active, ready, available) pods of the ReplicaSet."""
        active = [p for p in self.pods.owned_by(uid_of(rs)) if is_active(p)]
        return (
            len(active),
            sum(1 for p in active if is_ready(p)),
            sum(1 for p in active if available_in(p, min_ready) == 0),
        )

    def available(self, d: Obj, rs: Obj) -> int:
        return min(self.pod_counts(rs, int((d.get("spec") or {}).get("minReadySeconds") or 0))[2], replicas_of(rs))

    # ---- writes ------------------------------------------------------------------------------------

    def _annotations(self, d: Obj) -> dict[str, str]:
        surge, _ = surge_and_unavailable(d)
        return {DESIRED: str(replicas_of(d)), MAX_REPLICAS: str(replicas_of(d) + surge)}

    async def scale(self, d: Obj, rs: Obj, replicas: int) -> Obj:
        before = replicas_of(rs)
        notes = self._annotations(d)
        have = (rs.get("metadata") or {}).get("annotations") or {}
        if before == replicas and all(have.get(k) == v for k, v in notes.items()):
            return rs
        ns, name = key_of(rs)
        updated = await self.kube.patch(
            REPLICASETS, ns, name, {"metadata": {"annotations": notes}, "spec": {"replicas": replicas}}
        )
        self.replicasets.apply(updated)
        if before != replicas:
            verb = "up" if replicas > before else "down"
            log.info("replicaset scaled", deployment=f"{ns}/{key_of(d)[1]}", replicaset=name, replicas=replicas)
            await record_event(
                self.kube,
                d,
                self.component,
                "ScalingReplicaSet",
                f"Scaled {verb} replica set {name} from {before} to {replicas}",
            )
        return updated

    async def create_new(self, d: Obj, replicas: int, old: list[Obj]) -> Obj | None:
        ns, name = key_of(d)
        spec = d.get("spec") or {}
        collisions = int((d.get("status") or {}).get("collisionCount") or 0)
        h = template_hash(spec.get("template") or {}, collisions)
        template = copy.deepcopy(spec.get("template") or {})
        template.setdefault("metadata", {}).setdefault("labels", {})[HASH_LABEL] = h
        selector = copy.deepcopy(spec.get("selector") or {})
        selector.setdefault("matchLabels", {})[HASH_LABEL] = h
        revision = max([revision_of(rs) for rs in old] + [0]) + 1
        body = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": f"{name}-{h}",
                "namespace": ns,
                "labels": dict(template["metadata"]["labels"]),
                "annotations": {**self._annotations(d), REVISION: str(revision)},
                "ownerReferences": [owner_ref(d, "apps/v1", "Deployment")],
            },
            "spec": {
                "replicas": replicas,
                "minReadySeconds": int(spec.get("minReadySeconds") or 0),
                "selector": selector,
                "template": template,
            },
        }
        try:
            created = await self.kube.create(REPLICASETS, ns, body)
        except ApiError as exc:
            if exc.status != 409:
                raise
            existing = await self.kube.get(REPLICASETS, ns, f"{name}-{h}")
            refs = (existing.get("metadata") or {}).get("ownerReferences") or []
            if any(r.get("controller") and r.get("uid") == uid_of(d) for r in refs) and without_hash(
                (existing.get("spec") or {}).get("template") or {}
            ) == spec.get("template"):
                self.replicasets.apply(existing)
                return existing
            log.warning(
                "replicaset name collision; bumping collisionCount", deployment=f"{ns}/{name}", replicaset=f"{name}-{h}"
            )
            await write_status(
                self.kube,
                DEPLOYMENTS,
                self.deployments,
                d,
                {**(d.get("status") or {}), "collisionCount": collisions + 1},
            )
            return None
        self.replicasets.apply(created, "ADDED")
        log.info(
            "replicaset created",
            deployment=f"{ns}/{name}",
            replicaset=f"{name}-{h}",
            replicas=replicas,
            revision=revision,
        )
        await record_event(
            self.kube, d, self.component, "ScalingReplicaSet", f"Scaled up replica set {name}-{h} from 0 to {replicas}"
        )
        return created

    # ---- the reconcile -----------------------------------------------------------------------------

    async def reconcile(self, namespace: str, name: str) -> float | None:
        d = self.deployments.get(namespace, name)
        if d is None or (d.get("metadata") or {}).get("deletionTimestamp"):
            return None
        with tracer.start_as_current_span(
            "controllers.reconcile_deployment",
            attributes={"k8s.namespace.name": namespace, "k8s.deployment.name": name},
        ) as span:
            spec = d.get("spec") or {}
            new, old = self.split(d)
            span.set_attribute("gpu_dra.replicasets", len(old) + (new is not None))
            if not spec.get("paused"):
                if (spec.get("strategy") or {}).get("type") == "Recreate":
                    await self.recreate(d, new, old)
                else:
                    await self.rolling(d, new, old)
                await self.cleanup(d)
            await self.update_status(namespace, name)
            return None

    async def recreate(self, d: Obj, new: Obj | None, old: list[Obj]) -> None:
        for rs in old:
            await self.scale(d, rs, 0)
        if any(
            (p.get("status") or {}).get("phase") not in DONE_PHASES
            for rs in old
            for p in self.pods.owned_by(uid_of(rs))
        ):
            return  # old pods still run or terminate; their deletions wake us (through the ReplicaSets)
        if new is None:
            await self.create_new(d, replicas_of(d), old)
        else:
            await self.scale(d, new, replicas_of(d))

    async def rolling(self, d: Obj, new: Obj | None, old: list[Obj]) -> None:
        replicas = replicas_of(d)
        surge, unavailable = surge_and_unavailable(d)
        if new is None:
            total = sum(replicas_of(rs) for rs in old)
            want = replicas if not old else min(replicas, max(0, replicas + surge - total))
            new = await self.create_new(d, want, old)
            if new is None:
                return
        elif replicas_of(new) > replicas:
            new = await self.scale(d, new, replicas)
        elif replicas_of(new) < replicas:
            room = replicas + surge - sum(replicas_of(rs) for rs in [new, *old])
            if room > 0:
                new = await self.scale(d, new, replicas_of(new) + min(room, replicas - replicas_of(new)))
        live = sorted((rs for rs in old if replicas_of(rs) > 0), key=revision_of)
        if not live:
            return
        min_available = replicas - unavailable
        new_unavailable = replicas_of(new) - self.available(d, new)
        # First the old replicas that are not available anyway, then healthy ones, oldest first.
        budget = sum(replicas_of(rs) for rs in [new, *live]) - min_available - new_unavailable
        for i, rs in enumerate(live):
            if budget <= 0:
                break
            sick = replicas_of(rs) - self.available(d, rs)
            if sick > 0:
                down = min(budget, sick)
                live[i] = await self.scale(d, rs, replicas_of(rs) - down)
                budget -= down
        budget = sum(self.available(d, rs) for rs in [new, *live]) - min_available
        for rs in live:
            if budget <= 0:
                break
            down = min(budget, replicas_of(rs))
            if down > 0:
                await self.scale(d, rs, replicas_of(rs) - down)
                budget -= down

    async def cleanup(self, d: Obj) -> None:
        """Delete the oldest idle ReplicaSets beyond revisionHistoryLimit."""
        limit = (d.get("spec") or {}).get("revisionHistoryLimit")
        limit = 10 if limit is None else int(limit)
        _, old = self.split(d)
        idle = sorted(
            (rs for rs in old if replicas_of(rs) == 0 and not self.pods.owned_by(uid_of(rs))), key=revision_of
        )
        for rs in idle[: max(0, len(idle) - limit)]:
            ns, name = key_of(rs)
            await self.kube.delete(REPLICASETS, ns, name, uid=uid_of(rs))
            self.replicasets.mark_deleted(rs)
            log.info("old replicaset deleted", deployment=f"{ns}/{key_of(d)[1]}", replicaset=name)

    async def update_status(self, namespace: str, name: str) -> None:
        d = self.deployments.get(namespace, name)
        if d is None:
            return
        spec, status = d.get("spec") or {}, d.get("status") or {}
        min_ready = int(spec.get("minReadySeconds") or 0)
        new, old = self.split(d)
        counts = {key_of(rs)[1]: self.pod_counts(rs, min_ready) for rs in [*old, *([new] if new else [])]}
        active, ready, available = (sum(c[i] for c in counts.values()) for i in range(3))
        updated = counts[key_of(new)[1]][0] if new else 0
        replicas = replicas_of(d)
        _, unavailable = surge_and_unavailable(d)
        conds = list(status.get("conditions") or [])
        if available >= replicas - unavailable:
            conds = set_condition(
                conds,
                "Available",
                "True",
                "MinimumReplicasAvailable",
                "Deployment has minimum availability.",
                update=True,
            )
        else:
            conds = set_condition(
                conds,
                "Available",
                "False",
                "MinimumReplicasUnavailable",
                "Deployment does not have minimum availability.",
                update=True,
            )
        if spec.get("paused"):
            conds = set_condition(
                conds, "Progressing", "Unknown", "DeploymentPaused", "Deployment is paused", update=True
            )
        elif new is not None:
            rs_name = key_of(new)[1]
            done = updated == replicas and active == updated and available >= replicas
            conds = set_condition(
                conds,
                "Progressing",
                "True",
                "NewReplicaSetAvailable" if done else "ReplicaSetUpdated",
                f'ReplicaSet "{rs_name}" has successfully progressed.'
                if done
                else f'ReplicaSet "{rs_name}" is progressing.',
                update=True,
            )
        total = sum(replicas_of(rs) for rs in [*old, *([new] if new else [])])
        await write_status(
            self.kube,
            DEPLOYMENTS,
            self.deployments,
            d,
            compact(
                {
                    "observedGeneration": (d.get("metadata") or {}).get("generation"),
                    "replicas": active,
                    "updatedReplicas": updated,
                    "readyReplicas": ready,
                    "availableReplicas": available,
                    "unavailableReplicas": max(0, total - available),
                    "conditions": conds,
                    "collisionCount": status.get("collisionCount"),
                }
            ),
        )
