"""The one poll-until helper of the tests, for state that nothing pushes (an Event list, a file a process
writes, a status another process sets): `probe` is called (and awaited when it returns an awaitable) until
its answer is truthy, which is returned; an AssertionError naming `what` after `timeout` seconds."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def eventually(
    probe: Callable[[], Any], what: str = "condition", timeout: float = 10.0, every: float = 0.02
) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = probe()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
        await asyncio.sleep(every)
