"""The Job controller (NonIndexed completion): pods until enough succeed, or the Job fails.

Owns a Job's pods: those whose controller ownerReference carries the Job's uid. While the Job
is not finished it keeps min(parallelism, completions - succeeded) pods active (`<job>-<random5>`,
labelled `batch.kubernetes.io/job-name`, `batch.kubernetes.io/controller-uid`, `job-name`,
`controller-uid`). Pods are counted by status.phase (Succeeded/Failed; with restartPolicy
OnFailure container restarts count as failures too, as upstream); the counts never go down, so
a finished pod deleted later stays counted. The Job fails (FailureTarget + Failed) when failures
exceed backoffLimit, when activeDeadlineSeconds passes, or when the template's restartPolicy is
not Never/OnFailure; it completes (SuccessCriteriaMet + Complete, completionTime) when
`completions` pods succeeded (with `completions: null`, when one succeeded and none is active).
Either way its remaining active pods are deleted. `suspend` deletes active pods and sets
Suspended; ttlSecondsAfterFinished deletes a finished Job. Status goes through `/status`.
Not done: Indexed completion mode, podFailurePolicy, successPolicy, the delay before a failed
pod's replacement.
"""

from __future__ import annotations

import datetime as dt

from embedded.controllers.replicasets import (
    compact,
    condition_true,
    create_pods,
    delete_order,
    delete_pods,
    is_active,
    is_ready,
    now_iso,
    owner_ref,
    parse_time,
    pod_from_template,
    record_event,
    set_condition,
    write_status,
)
from shared.kube.informer import Informer, Obj, key_of, uid_of
from shared.kube.resources import JOBS, Kube
from shared.logs import get_logger
from shared.telemetry import get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)
JOB_NAME = "batch.kubernetes.io/job-name"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"


def _seconds_since(stamp: str | None) -> float | None:
    when = parse_time(stamp)
    return None if when is None else (dt.datetime.now(dt.UTC) - when).total_seconds()


def _phase(pod: Obj) -> str:
    return str((pod.get("status") or {}).get("phase") or "")


class JobController:
    component = "job-controller"

    def __init__(self, kube: Kube, jobs: Informer, pods: Informer) -> None:
        self.kube = kube
        self.jobs = jobs
        self.pods = pods

    def pods_of(self, job: Obj) -> list[Obj]:
        ns = key_of(job)[0]
        return [p for p in self.pods.owned_by(uid_of(job)) if key_of(p)[0] == ns]

    def pod_body(self, job: Obj) -> Obj:
        ns, name = key_of(job)
        uid = uid_of(job)
        labels = {JOB_NAME: name, CONTROLLER_UID: uid, "job-name": name, "controller-uid": uid}
        template = (job.get("spec") or {}).get("template") or {}
        return pod_from_template(template, ns, f"{name}-", owner_ref(job, "batch/v1", "Job"), labels)

    async def reconcile(self, namespace: str, name: str) -> float | None:
        job = self.jobs.get(namespace, name)
        if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
            return None
        with tracer.start_as_current_span(
            "controllers.reconcile_job", attributes={"k8s.namespace.name": namespace, "k8s.job.name": name}
        ) as span:
            again = await self.sync(job)
            span.set_attribute(
                "gpu_dra.job.finished",
                condition_true(self.jobs.get(namespace, name) or job, "Complete")
                or condition_true(self.jobs.get(namespace, name) or job, "Failed"),
            )
            return again

    async def sync(self, job: Obj) -> float | None:
        ns, name = key_of(job)
        spec, status = job.get("spec") or {}, dict(job.get("status") or {})
        pod_spec = (spec.get("template") or {}).get("spec") or {}
        pods = self.pods_of(job)
        active = [p for p in pods if is_active(p)]
        restarts = 0
        if pod_spec.get("restartPolicy") == "OnFailure":
            restarts = sum(
                int(cs.get("restartCount") or 0)
                for p in active
                for cs in (p.get("status") or {}).get("containerStatuses") or []
            )
        succeeded = max(int(status.get("succeeded") or 0), sum(1 for p in pods if _phase(p) == "Succeeded"))
        failed = max(int(status.get("failed") or 0), sum(1 for p in pods if _phase(p) == "Failed"))
        conds = list(status.get("conditions") or [])
        finished = condition_true(job, "Complete") or condition_true(job, "Failed")
        again: float | None = None
        if not finished:
            completions = spec.get("completions")
            parallelism = 1 if spec.get("parallelism") is None else int(spec["parallelism"])
            backoff = 6 if spec.get("backoffLimit") is None else int(spec["backoffLimit"])
            suspended = bool(spec.get("suspend"))
            if suspended:
                status.pop("startTime", None)
            elif not status.get("startTime"):
                status["startTime"] = now_iso()
            deadline = spec.get("activeDeadlineSeconds")
            elapsed = _seconds_since(status.get("startTime"))
            failure: tuple[str, str] | None = None
            policy = pod_spec.get("restartPolicy")
            if policy not in ("Never", "OnFailure"):
                failure = (
                    "InvalidRestartPolicy",
                    f"the pod template's restartPolicy must be Never or OnFailure, not {policy!r}",
                )
            elif failed + restarts > backoff:
                failure = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
            elif deadline is not None and elapsed is not None and elapsed >= int(deadline):
                failure = ("DeadlineExceeded", "Job was active longer than specified deadline")
            complete = (succeeded >= int(completions)) if completions is not None else (succeeded > 0 and not active)
            if failure is not None:
                await delete_pods(self.kube, self.pods, active)
                for kind in ("FailureTarget", "Failed"):
                    conds = set_condition(conds, kind, "True", failure[0], failure[1], probe=True)
                log.info("job failed", job=f"{ns}/{name}", reason=failure[0], failed=failed, succeeded=succeeded)
                await record_event(self.kube, job, self.component, failure[0], failure[1], warning=True)
            elif complete:
                await delete_pods(self.kube, self.pods, active)
                for kind in ("SuccessCriteriaMet", "Complete"):
                    conds = set_condition(
                        conds,
                        kind,
                        "True",
                        "CompletionsReached",
                        "Reached expected number of succeeded pods",
                        probe=True,
                    )
                status["completionTime"] = now_iso()
                log.info("job complete", job=f"{ns}/{name}", succeeded=succeeded, failed=failed)
                await record_event(self.kube, job, self.component, "Completed", "Job completed")
            elif suspended:
                await delete_pods(self.kube, self.pods, active)
                conds = set_condition(conds, "Suspended", "True", "JobSuspended", "Job suspended", probe=True)
            else:
                if any(c.get("type") == "Suspended" for c in conds):
                    conds = set_condition(conds, "Suspended", "False", "JobResumed", "Job resumed", probe=True)
                if completions is None:
                    want = 0 if succeeded else parallelism
                else:
                    want = max(0, min(parallelism, int(completions) - succeeded))
                await self.scale(job, active, want)
                if deadline is not None and elapsed is not None:
                    again = max(0.0, int(deadline) - elapsed) + 0.05
        else:
            again = await self.expire(job)
        active = [p for p in self.pods_of(job) if is_active(p)]
        status.update(
            {
                "active": len(active),
                "ready": sum(1 for p in active if is_ready(p)),
                "succeeded": succeeded,
                "failed": failed,
                "conditions": conds,
            }
        )
        current = self.jobs.get(ns, name)
        if current is not None and uid_of(current) == uid_of(job):
            await write_status(self.kube, JOBS, self.jobs, current, compact(status, keep=("ready",)))
        return again

    async def scale(self, job: Obj, active: list[Obj], want: int) -> None:
        ns, name = key_of(job)
        if len(active) < want:
            made = 0
            try:
                made = await create_pods(self.kube, self.pods, ns, want - len(active), lambda: self.pod_body(job))
            finally:
                if made:
                    log.info("job pods created", job=f"{ns}/{name}", count=made, want=want)
                    await record_event(
                        self.kube, job, self.component, "SuccessfulCreate", f"Created {made} pod(s) for Job {name}"
                    )
        elif len(active) > want:
            victims = delete_order(active)[: len(active) - want]
            await delete_pods(self.kube, self.pods, victims)
            log.info("job pods deleted", job=f"{ns}/{name}", count=len(victims), want=want)

    async def expire(self, job: Obj) -> float | None:
        """ttlSecondsAfterFinished: delete the finished Job once it has passed; else when to look again."""
        ttl = (job.get("spec") or {}).get("ttlSecondsAfterFinished")
        if ttl is None:
            return None
        status = job.get("status") or {}
        finished_at = status.get("completionTime") or next(
            (c.get("lastTransitionTime") for c in status.get("conditions") or [] if c.get("type") == "Failed"), None
        )
        since = _seconds_since(finished_at)
        if since is None:
            return None
        if since < int(ttl):
            return int(ttl) - since + 0.05
        ns, name = key_of(job)
        await self.kube.delete(JOBS, ns, name, uid=uid_of(job), propagation="Background")
        self.jobs.mark_deleted(job)
        log.info("finished job deleted after its TTL", job=f"{ns}/{name}", ttl_s=ttl)
        return None
