"""Child processes of the local cluster: start each service as its own OS process, stop them all.

Owns process groups, per-process log files, the environment each service gets, waiting for a
readiness condition while watching for an early exit, and a shutdown that leaves nothing behind
(SIGTERM to the group, SIGKILL after a grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared.logs import get_logger

log = get_logger(__name__)


class ProcessFailed(RuntimeError):
    """A service exited while the cluster was starting or running; the message names its log."""


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def gpu_dra(*args: str) -> list[str]:
    """The argv that runs a `gpu-dra` subcommand with this interpreter."""
    return [sys.executable, "-m", "shared.cli", *args]


class Supervisor:
    """Starts children, fails fast when one dies, and stops them in reverse order."""

    def __init__(self, log_dir: Path, base_env: dict[str, str] | None = None):
        self.log_dir = log_dir
        self.base_env = base_env or {}
        self.children: list[Child] = []
        self._watchers: list[asyncio.Task[None]] = []
        self.failed: asyncio.Future[Child] = asyncio.get_running_loop().create_future()
        self._stopping = False

    async def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name=name, argv=argv, log_path=self.log_dir / f"{name}.log", env=env or {})
        full_env = {**os.environ, **self.base_env, **child.env}
        log_file = await asyncio.to_thread(open, child.log_path, "ab")
        try:
            child.process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=asyncio.subprocess.STDOUT,
                env=full_env, start_new_session=True)
        finally:
            log_file.close()
        self.children.append(child)
        self._watchers.append(asyncio.create_task(self._watch(child), name=f"watch-{name}"))
        log.info("started", process=name, pid=child.pid, log=str(child.log_path))
        return child

    async def _watch(self, child: Child) -> None:
        assert child.process is not None
        code = await child.process.wait()
        if not self._stopping and not self.failed.done():
            log.error("process exited", process=child.name, code=code, log=str(child.log_path))
            self.failed.set_result(child)

    async def wait_until(self, what: str, condition: Callable[[], Awaitable[bool]], timeout: float = 60.0,
                         wake: Callable[[], Awaitable[None]] | None = None) -> None:
        """Await `condition()` becoming true; ProcessFailed at once if a child dies meanwhile.

        `wake` awaits the next change worth re-checking on (an event); without it the condition is
        polled with a short back-off, for conditions that have no event (a socket file appearing).
        """
        async def satisfied() -> None:
            delay = 0.02
            while not await condition():
                if wake is not None:
                    await wake()
                else:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)

        waiter = asyncio.ensure_future(satisfied())
        try:
            done, _ = await asyncio.wait({waiter, self.failed}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiter.done():
                waiter.cancel()
        if waiter in done:
            waiter.result()
            return
        if self.failed.done():
            child = self.failed.result()
            raise ProcessFailed(f"{child.name} exited while waiting for {what}; last lines of "
                                f"{child.log_path}:\n{child.tail()}")
        raise ProcessFailed(f"timed out after {timeout:.0f}s waiting for {what}; logs are in {self.log_dir}")

    async def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every child's process group (newest first), SIGKILL what is left after `grace`."""
        self._stopping = True
        for child in reversed(self.children):
            _signal_group(child, signal.SIGTERM)
        for child in reversed(self.children):
            assert child.process is not None
            try:
                await asyncio.wait_for(child.process.wait(), grace)
            except TimeoutError:
                log.warning("process did not stop in time; killing it", process=child.name, pid=child.pid)
                _signal_group(child, signal.SIGKILL)
                await child.process.wait()
            _signal_group(child, signal.SIGKILL)  # stragglers the service itself spawned
        for watcher in self._watchers:
            watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._watchers, return_exceptions=True)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    if child.process is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.process.pid, sig)
