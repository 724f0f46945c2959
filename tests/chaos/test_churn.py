"""The chaos run's killer carries out a kill scheduled at the last pods' creates: it waits on the pods created,
and every create tells it, including those that land after the churn has started its last pod."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from bench.chaos_churn import Run, churn, killer


class SlowCreates:
    """The API as the churn uses it: pod creates land only once `landed` is set (`held` is set once `pods` of them
    wait), deletes at once."""

    def __init__(self, pods: int) -> None:
        self.pods = pods
        self.waiting = 0
        self.held = asyncio.Event()
        self.landed = asyncio.Event()
        self.created: list[str] = []

    async def call(self, what: Any, timeout: float = 120) -> Any:
        return await what(self)

    async def create(self, _plural: Any, _ns: str, body: dict[str, Any]) -> None:
        self.waiting += 1
        if self.waiting == self.pods:
            self.held.set()
        await self.landed.wait()
        self.created.append(body["metadata"]["name"])

    async def delete(self, _plural: Any, _ns: str, _name: str) -> None:
        return None


class OneProcess:
    """`gpu-dra up` as the killer sees it: one target, one real process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def pids(self, target: str, node: str = "") -> list[int]:
        return [self.pid]


async def test_a_kill_due_at_the_last_pods_is_carried_out_when_their_creates_land_after_the_churn_loop() -> None:
    victim = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        run = Run(pods=2, seed=1, nodes=["n"])
        api = SlowCreates(run.pods)
        progress = asyncio.Condition()
        # due once 1.7 pods exist: only the second create lets it go
        kill = asyncio.create_task(killer(OneProcess(victim.pid), run, [(0.85, "preparer", "n")], progress))  # type: ignore[arg-type]
        churning = asyncio.create_task(churn(api, run, 2, 0.05, progress))  # type: ignore[arg-type]
        await asyncio.wait_for(api.held.wait(), 10)  # the churn has started both pods; their creates wait
        assert not kill.done() and run.created == 0
        api.landed.set()
        async with asyncio.timeout(10):
            await churning
            await kill
        assert sorted(api.created) == ["chaos-0", "chaos-1"] and run.created == 2
        assert [(t, n) for t, n, _ in run.kills] == [("preparer", "n")]
        assert await asyncio.wait_for(victim.wait(), 10) == -signal.SIGKILL
    finally:
        if victim.returncode is None:
            victim.kill()
            await victim.wait()
