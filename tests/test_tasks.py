"""Cancellation that holds where a callee drops the CancelledError (shared.tasks)."""

from __future__ import annotations

import asyncio

import pytest

from shared.tasks import cancel_and_wait, raise_if_cancelling


async def test_cancel_and_wait_ends_a_task_that_swallows_its_first_cancellation() -> None:
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()  # as nats-py may, mid-flush
        await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([task], again_after_s=0.05), 5)
    assert swallowed.is_set() and task.cancelled()


async def test_a_watch_loop_cancelled_as_its_update_arrives_ends() -> None:
    """The shape of nats-py's KV `updates()`: `wait_for(queue.get(), timeout)`. An update and the
    cancellation arriving in the same loop turn can leave the loop running (Python 3.11's wait_for
    returns the update); the guard after each update ends it."""
    updates: asyncio.Queue[int] = asyncio.Queue()

    async def watch() -> None:
        while True:
            await asyncio.wait_for(updates.get(), 3600)
            raise_if_cancelling()

    task = asyncio.create_task(watch())
    await asyncio.sleep(0)  # the task now waits in wait_for
    updates.put_nowait(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
