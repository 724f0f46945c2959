"""The one work queue (shared.workqueue): a key once however often added, a busy key handed out again only
once done, the causes handed out with it, and idle only when nothing waits or runs."""

from __future__ import annotations

import asyncio

from opentelemetry import context as otel_context

from shared.workqueue import WorkQueue


async def test_a_key_is_queued_once_and_a_busy_key_waits_for_done() -> None:
    queue: WorkQueue[str] = WorkQueue()
    first, second = otel_context.Context({"a": 1}), otel_context.Context({"b": 2})
    queue.add("n1", first)
    queue.add("n1", second)
    queue.add("n2")
    assert len(queue) == 2
    assert await queue.get() == ("n1", [first, second])
    queue.add("n1")  # while it is being worked on
    assert await queue.get() == ("n2", [])
    getter = asyncio.create_task(queue.get())
    await asyncio.sleep(0)
    assert not getter.done(), "n1 is handed out again only once its first run is done"
    queue.done("n1")
    assert await getter == ("n1", [])
    idle = asyncio.create_task(queue.wait_idle())
    queue.done("n2")
    await asyncio.sleep(0)
    assert not idle.done(), "n1 still runs"
    queue.done("n1")
    await asyncio.wait_for(idle, 1)
    assert len(queue) == 0
