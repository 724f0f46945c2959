"""Cancellation that holds where a callee drops the CancelledError (shared.tasks)."""

from __future__ import annotations

import asyncio

import pytest

from shared.tasks import cancel_and_wait, finish_even_if_cancelled, raise_if_cancelling


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


async def test_a_teardown_runs_to_its_end_through_cancellations_then_the_caller_is_cancelled() -> None:
    entered, release, finished = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def teardown() -> None:
        entered.set()
        await release.wait()
        finished.set()

    caller = asyncio.create_task(finish_even_if_cancelled(teardown()))
    await entered.wait()
    for _ in range(3):  # Ctrl-C, Ctrl-C, SIGTERM during the teardown
        caller.cancel()
        await asyncio.sleep(0)
    assert not caller.done() and not finished.is_set()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert finished.is_set()


async def test_a_teardown_that_is_not_interrupted_returns_its_result() -> None:
    async def teardown() -> int:
        return 7

    assert await finish_even_if_cancelled(teardown()) == 7
