"""Leader election over a real Lease on the embedded API server: one leader, standby takeover."""

from __future__ import annotations

import asyncio
import time

from kubernetes_asyncio import client

from embedded.apiserver.testing import running_apiserver
from services.computedomain.leader import LeaderElector


def elector(kube, name: str) -> LeaderElector:
    return LeaderElector(
        kube,
        namespace="default",
        name="cd-controller",
        identity=name,
        lease_duration=2.0,
        renew_deadline=1.5,
        retry_period=0.2,
    )


async def test_one_leader_then_the_standby_takes_over_within_the_lease_duration(tmp_path):
    async with running_apiserver(tmp_path) as api, api.client() as kube:
        a, b = elector(kube, "a"), elector(kube, "b")
        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        leading: list[str] = []

        def work(name: str):
            async def lead(lost: asyncio.Event) -> None:
                leading.append(name)
                await lost.wait()

            return lead

        task_a = asyncio.create_task(a.run(stop_a, work("a")))
        await asyncio.wait_for(a.leading.wait(), 5)
        task_b = asyncio.create_task(b.run(stop_b, work("b")))
        # b sees a renewing and stays standby for several lease periods' worth of attempts
        lease = await client.CoordinationV1Api(kube).read_namespaced_lease("cd-controller", "default")
        assert lease.spec.holder_identity == a.identity
        await asyncio.sleep(0)  # let b make its first attempt
        assert not b.leading.is_set()

        # the leader dies without releasing (cancelled: no renewals, no release)
        task_a.cancel()
        killed = time.monotonic()
        await asyncio.wait_for(b.leading.wait(), 5)
        took_over = time.monotonic() - killed
        assert 1.0 < took_over <= 2.0 + 0.2 + 0.3, took_over  # lease duration + one retry period (+ scheduling)
        lease = await client.CoordinationV1Api(kube).read_namespaced_lease("cd-controller", "default")
        assert lease.spec.holder_identity == b.identity and lease.spec.lease_transitions == 1
        assert leading == ["a", "b"]

        # a clean stop releases the Lease: a new candidate leads at its first attempt
        stop_b.set()
        await task_b
        c = elector(kube, "c")
        stop_c = asyncio.Event()
        task_c = asyncio.create_task(c.run(stop_c, work("c")))
        started = time.monotonic()
        await asyncio.wait_for(c.leading.wait(), 5)
        assert time.monotonic() - started < 1.0
        stop_c.set()
        await task_c
