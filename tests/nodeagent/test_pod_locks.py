"""The kubelet emulator handles one event of a pod at a time, also as the pod is forgotten: a sync that waited
on the pod's lock while it was being forgotten and a sync that comes right after do not run side by side."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from embedded.nodeagent.plugins import PluginRegistry
from embedded.nodeagent.pods import PodRunner
from tests.nodeagent.test_retry_loop import unreachable_api


async def settle() -> None:
    for _ in range(5):  # what is runnable runs
        await asyncio.sleep(0)


async def test_a_sync_waiting_while_its_pod_is_forgotten_and_the_next_one_run_one_at_a_time(tmp_path: Path) -> None:
    api = unreachable_api()
    try:
        runner = PodRunner("n", api, PluginRegistry(tmp_path / "reg"), [], state_dir=tmp_path / "state")
        releasing, release, syncs_go = asyncio.Event(), asyncio.Event(), asyncio.Event()
        inside: list[int] = []  # syncs under the pod's lock now
        most = 0

        async def slow_release(pod_uid: str) -> bool:
            releasing.set()
            await release.wait()
            return True

        async def counted_sync(pod: dict[str, Any], force: bool) -> bool:
            nonlocal most
            inside.append(1)
            most = max(most, len(inside))
            await syncs_go.wait()
            inside.pop()
            return False

        runner._release_pod = slow_release  # type: ignore[method-assign]
        runner._sync_locked = counted_sync  # type: ignore[method-assign]
        pod = {"metadata": {"name": "p", "namespace": "default", "uid": "u1"}, "spec": {}, "status": {}}

        forget = asyncio.create_task(runner.forget_pod("u1"))
        await releasing.wait()  # the pod's lock is held by the forget
        waiting = asyncio.create_task(runner.sync_pod(pod))
        await settle()
        release.set()
        await forget  # gone while `waiting` was woken but had not run yet
        after = asyncio.create_task(runner.sync_pod(pod))
        await settle()
        assert most == 1, "two syncs of one pod ran at once"
        syncs_go.set()
        await asyncio.gather(waiting, after)
        assert len(runner._pod_locks) == 0, "nobody holds or waits: no lock is kept"
    finally:
        await api.close()
