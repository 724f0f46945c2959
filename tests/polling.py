"""The tests' poll-until helpers, for state that nothing pushes. `eventually`: an Event list, a file a process
writes, a status another process sets: `probe` is called (and awaited when it returns an awaitable) until
its answer is truthy, which is returned; an AssertionError naming `what` after `timeout` seconds. `wait_gone` and
`gone`: the exit of a process that is not our child (no event to await), told by /proc."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from pathlib import Path
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


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    """True once process `pid` has exited (looked at once at least), False if it still runs after `timeout`."""
    deadline = time.monotonic() + timeout
    while running(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def gone(pids: list[int], timeout: float = 30) -> list[int]:
    """Those of `pids` still running after `timeout` (one deadline for all)."""
    deadline = time.monotonic() + timeout
    return [p for p in pids if not wait_gone(p, deadline - time.monotonic())]
