"""The tests' poll-until helpers, for state that nothing pushes. `eventually`: an Event list, a file a process
writes, a status another process sets: `probe` is called (and awaited when it returns an awaitable) until
its answer is truthy, which is returned; an AssertionError naming `what` after `timeout` seconds. `wait_gone` and
`gone`: the exit of a process that is not our child (no event to await), told by /proc; `wait_stopped`: a SIGSTOP
having reached every thread of a process."""

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


def _state(stat: Path) -> str:
    """A process's or thread's state letter from its /proc stat ("" once it is gone)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    return _state(Path(f"/proc/{pid}/stat")) not in ("", "Z")


def wait_stopped(pid: int, timeout: float = 5.0) -> bool:
    """True once every thread of process `pid` is stopped. kill() returns before a SIGSTOP has reached a thread
    running on another CPU: nats-server went on for up to 5 ms after it (3 times in 300 on 2 cores), enough to answer
    a request sent after the kill."""
    deadline = time.monotonic() + timeout
    while any(_state(task / "stat") not in ("T", "t") for task in Path(f"/proc/{pid}/task").iterdir()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0005)
    return True


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
