"""Cancellation that holds even where a library or the runtime drops a CancelledError.

Two known places lose one: nats-py swallows a CancelledError that arrives while it flushes a
publish (`Client._flush_pending`), and Python 3.11's `asyncio.wait_for` returns the inner result
instead of raising when that result and the cancellation arrive together. A task cancelled there
runs on, so code that cancels a loop and then awaits it can wait forever. And the reverse: a
teardown that must complete although its caller is cancelled again (`finish_even_if_cancelled`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


def cancelling() -> bool:
    """Whether the current task has been asked to cancel (stays true after a swallowed CancelledError)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def raise_if_cancelling() -> None:
    """Raise the CancelledError a callee swallowed; call it at the top of a loop that awaits such a callee."""
    if cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]], *, again_after_s: float = 0.5) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again any that swallowed it."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_after_s)


async def finish_even_if_cancelled(aw: Awaitable[T]) -> T:
    """Await `aw` to its end even when the caller is cancelled meanwhile (a teardown that must not stop
    half-way: a second Ctrl-C during it); the caller's cancellation is raised once `aw` is done."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
