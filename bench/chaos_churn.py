"""The chaos run's load and its kills (bench/chaos.py): the claim templates and the standalone shared
claim its pods use, the run's record (`Run`), the churn of pods (created, watched until Running, held,
deleted, watched until gone), and the seeded kill schedule with the killer that carries it out."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.chaos_cluster import CLUSTER_TARGETS, NODE_TARGETS, NS, Api, UpProcess, log
from shared.kube.resources import PODS, RESOURCECLAIMS, Kube
from shared.kube.rest import ApiError

LABEL = "chaos"
GPU_CONFIG = {
    "apiVersion": "resource.nvidia.com/v1beta1",
    "kind": "GpuConfig",
    "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
}
TEMPLATES = {
    "chaos-gpu": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]},
    "chaos-ts-gpu": {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": GPU_CONFIG}}],
    },
}


@dataclass
class Run:
    pods: int
    seed: int
    nodes: list[str]
    created: int = 0
    succeeded: set[str] = field(default_factory=set)
    never_running: set[str] = field(default_factory=set)
    never_gone: set[str] = field(default_factory=set)
    claim_of: dict[str, tuple[str, str]] = field(default_factory=dict)  # pod -> (claim uid, node) once Running
    kills: list[tuple[str, str, float]] = field(default_factory=list)  # (target, node, wall time)
    doubles: set[str] = field(default_factory=set)
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)  # pod name -> last listed object
    listed: asyncio.Event = field(default_factory=asyncio.Event)


SHARED_CLAIM = "chaos-shared"  # a standalone claim: pods at once share it, pods one after another re-prepare it


def pod_body(name: str, template: str) -> dict[str, Any]:
    """A pod whose claim comes from `template`, or is the standalone SHARED_CLAIM."""
    ref = {"resourceClaimName": SHARED_CLAIM} if template == SHARED_CLAIM else {"resourceClaimTemplateName": template}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {LABEL: "1"}},
        "spec": {
            "containers": [{"name": "ctr", "image": "ubuntu:22.04", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", **ref}],
        },
    }


def is_running(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []
    )


async def poll_pods(api: Api, run: Run) -> None:
    """One list of the churn's pods at a time; the workers wait on `run.listed` for news."""
    while True:
        pods, _ = await api.call(lambda k: k.list(PODS, NS, label_selector=f"{LABEL}=1"))
        run.seen = {p["metadata"]["name"]: p for p in pods}
        run.listed.set()
        run.listed = asyncio.Event()
        await asyncio.sleep(0.25)


async def until(run: Run, check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.listed.wait(), left)
    return True


async def pod_life(
    api: Api, run: Run, name: str, template: str, hold: float, pod_timeout: float, progress: asyncio.Condition
) -> None:
    async def create(k: Kube) -> None:
        try:
            await k.create(PODS, NS, pod_body(name, template))
        except ApiError as exc:
            if exc.status != 409:  # a retry of a create that landed
                raise

    await api.call(create)
    async with progress:  # the count and its notice together: a waiter never misses the last pods' creates
        run.created += 1
        progress.notify_all()
    if await until(run, lambda: name in run.seen and is_running(run.seen[name]), pod_timeout):
        run.succeeded.add(name)
        pod = run.seen[name]
        claim = (
            SHARED_CLAIM
            if template == SHARED_CLAIM
            else ((pod.get("status") or {}).get("resourceClaimStatuses") or [{}])[0].get("resourceClaimName", "")
        )
        if claim:
            with contextlib.suppress(ApiError):
                obj = await api.call(lambda k: k.get(RESOURCECLAIMS, NS, claim))
                run.claim_of[name] = (obj["metadata"]["uid"], pod["spec"].get("nodeName", ""))
        await asyncio.sleep(hold)
    else:
        run.never_running.add(name)

    async def delete(k: Kube) -> None:
        try:
            await k.delete(PODS, NS, name)
        except ApiError as exc:
            if not exc.not_found:
                raise

    await api.call(delete)
    if not await until(run, lambda: name not in run.seen, pod_timeout):
        run.never_gone.add(name)


def claim_source(i: int) -> str:
    """Where the churn's i-th pod's claim comes from: the standalone SHARED_CLAIM or a template."""
    return SHARED_CLAIM if i % 5 == 4 else "chaos-ts-gpu" if i % 3 == 2 else "chaos-gpu"


async def churn(api: Api, run: Run, concurrency: int, pod_timeout: float, progress: asyncio.Condition) -> None:
    rng = random.Random(run.seed)
    slots = asyncio.Semaphore(concurrency)
    tasks = []

    async def one(i: int) -> None:
        try:
            await pod_life(api, run, f"chaos-{i}", claim_source(i), rng.uniform(0, 0.3), pod_timeout, progress)
        finally:
            slots.release()

    for i in range(run.pods):
        await slots.acquire()
        tasks.append(asyncio.create_task(one(i)))
        if (i + 1) % 50 == 0:
            log(f"{i + 1}/{run.pods} pods started, {len(run.succeeded)} ran, {len(run.kills)} kills")
    await asyncio.gather(*tasks)


def kill_schedule(run: Run, kills_each: int) -> list[tuple[float, str, str]]:
    """(fraction of the pods created, target, node) for every kill, in order; seeded."""
    rng = random.Random(run.seed * 7919 + 1)
    targets = [(t, "") for t in CLUSTER_TARGETS] + [(t, n) for n in run.nodes for t in NODE_TARGETS]
    plan = [(t, n) for t, n in targets for _ in range(kills_each)]
    rng.shuffle(plan)
    fractions = sorted(rng.uniform(0.05, 0.85) for _ in plan)
    return [(f, t, n) for f, (t, n) in zip(fractions, plan, strict=True)]


async def killer(up: UpProcess, run: Run, schedule: list[tuple[float, str, str]], progress: asyncio.Condition) -> None:
    for fraction, target, node in schedule:
        async with progress:
            await progress.wait_for(lambda f=fraction: run.created >= f * run.pods)  # type: ignore[misc]
        deadline = time.monotonic() + 60
        while not (pids := up.pids(target, node)):  # still waiting out a restart backoff
            if time.monotonic() > deadline:
                raise RuntimeError(f"{target} {node} did not come back within 60 s")
            await asyncio.sleep(0.2)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.kills.append((target, node, time.time()))
        log(f"SIGKILL {target} {node} (pid {','.join(map(str, pids))}) at pod {run.created}")
