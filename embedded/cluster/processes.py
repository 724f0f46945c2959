"""Child processes of the local cluster: start each service as its own OS process, keep it running, stop them all.

Owns process groups, per-process log files, the environment each service gets (this process's, less its
`GPU_DRA_*` settings, plus what the caller gives), restarts (a service
that exits or is killed is started again after the project's backoff, as the kubelet restarts a
DaemonSet pod, and the restart is logged, reported and counted), waiting for a readiness condition,
and a shutdown that leaves nothing behind (SIGTERM to the group, SIGKILL after a grace period).
Every child gets SIGTERM from the kernel if this process dies, even by SIGKILL (shared.parentdeath).
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
from typing import Any

from prometheus_client import Counter, Gauge

from shared.backoff import Backoff
from shared.config import without_settings
from shared.logs import get_logger
from shared.parentdeath import with_parent_death_signal

log = get_logger(__name__)

RESTARTS = Counter("gpu_dra_up_process_restarts", "Times a service of the local cluster was restarted", ["process"])
RUNNING = Gauge(
    "gpu_dra_up_process_running", "1 while the service's process runs, 0 while it waits to restart", ["process"]
)

USAGE_EXIT = 2
"""What a service exits with when its flags or settings are refused: starting it again cannot help."""


class ProcessFailed(RuntimeError):
    """A service cannot be kept running (its settings were refused), or a start-up condition never came;
    the message names its log."""


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    last_exit: int | None = None  # the exit status of the previous run (negative: killed by that signal)
    started_at: float = 0.0

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


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


class Supervisor:
    """Starts children, restarts one that exits (with backoff), and stops them all.

    `restart=False` is for harnesses that must see any exit: a child that exits is then `failed`."""

    def __init__(
        self,
        log_dir: Path,
        base_env: dict[str, str] | None = None,
        report: Callable[[str], None] | None = None,
        backoff: Callable[[], Backoff] = Backoff,
        restart: bool = True,
    ):
        self.log_dir = log_dir
        self.restart = restart
        self.base_env = base_env or {}
        self.report = report or (lambda line: None)
        self._backoff = backoff
        self.children: list[Child] = []
        self._loops: list[asyncio.Task[None]] = []
        # A child that cannot be kept running: it refused its settings (exit 2), or could not be started
        # (with restart=False: any child that exits).
        self.failed: asyncio.Future[Child] = asyncio.get_running_loop().create_future()
        self._stopping = asyncio.Event()

    def child(self, name: str) -> Child:
        for child in self.children:
            if child.name == name:
                return child
        raise KeyError(name)

    async def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        """Start `argv` as `name` (its output to <log_dir>/<name>.log) and keep it running until `stop()`."""
        if self._stopping.is_set():
            raise asyncio.CancelledError  # the cluster is being stopped: start nothing more
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name=name, argv=argv, log_path=self.log_dir / f"{name}.log", env=env or {})
        self.children.append(child)  # before the spawn: stop() must see it even if we are cancelled now
        await self._spawn(child)
        self._loops.append(asyncio.create_task(self._keep_running(child), name=f"supervise-{name}"))
        return child

    async def _spawn(self, child: Child) -> None:
        # no GPU_DRA_* setting of ours is inherited: a child gets the settings it is given (it refuses unknown ones)
        full_env = {**without_settings(os.environ), **self.base_env, **child.env}
        log_file = await asyncio.to_thread(open, child.log_path, "ab")
        try:
            child.process = await asyncio.create_subprocess_exec(
                *with_parent_death_signal(child.argv),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
            )
        finally:
            log_file.close()
        child.started_at = asyncio.get_running_loop().time()
        RUNNING.labels(child.name).set(1)
        log.info("started", process=child.name, pid=child.pid, restarts=child.restarts, log=str(child.log_path))

    async def _keep_running(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        backoff = self._backoff()
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            while True:
                assert child.process is not None
                exited = asyncio.ensure_future(child.process.wait())
                await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not exited.done():
                    exited.cancel()
                    return  # stop() ends the process
                code = exited.result()
                RUNNING.labels(child.name).set(0)
                ran = loop.time() - child.started_at
                child.last_exit = code
                if not self.restart:
                    log.error("process exited", process=child.name, code=code, log=str(child.log_path))
                    if not self.failed.done():
                        self.failed.set_result(child)
                    return
                if code == USAGE_EXIT:
                    log.error(
                        "process refused its settings; not restarting it",
                        process=child.name,
                        code=code,
                        log=str(child.log_path),
                    )
                    self.report(f"{child.name} refused its settings ({describe_exit(code)}); see {child.log_path}")
                    if not self.failed.done():
                        self.failed.set_result(child)
                    return
                backoff.ran(ran)
                delay = backoff.next()
                log.error(
                    "process exited; restarting it",
                    process=child.name,
                    pid=child.pid,
                    code=code,
                    ran_s=round(ran, 1),
                    restarts=child.restarts + 1,
                    backoff_s=delay,
                    log=str(child.log_path),
                )
                self.report(
                    f"{child.name} (pid {child.pid}) {describe_exit(code)} after {ran:.1f}s; "
                    f"restarting in {delay:.1f}s (restart {child.restarts + 1}); log {child.log_path}"
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stopping), delay)
                if stopping.done():
                    return
                try:
                    await self._spawn(child)
                except OSError as exc:
                    log.error("process cannot be started", process=child.name, error=str(exc))
                    self.report(f"{child.name} cannot be started: {exc}")
                    if not self.failed.done():
                        self.failed.set_result(child)
                    return
                child.restarts += 1
                RESTARTS.labels(child.name).inc()
                self.report(f"{child.name} restarted (pid {child.pid}, restart {child.restarts})")
        finally:
            stopping.cancel()

    async def wait_until(
        self,
        what: str,
        condition: Callable[[], Awaitable[bool]],
        timeout: float = 60.0,
        wake: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Await `condition()` becoming true; ProcessFailed when a child cannot be kept running meanwhile,
        or at `timeout` (naming the children that kept exiting, with the last lines of their logs).

        `wake` awaits the next change worth re-checking on (an event); without it the condition is
        polled with a short back-off, for conditions that have no event (a socket file appearing).
        """

        async def satisfied() -> None:
            backoff = Backoff(initial_s=0.02, cap_s=0.5)
            while not await condition():
                if wake is not None:
                    await wake()
                else:
                    await asyncio.sleep(backoff.next())

        waiter = asyncio.ensure_future(satisfied())
        try:
            watched: set[asyncio.Future[Any]] = {waiter, self.failed}
            done, _ = await asyncio.wait(watched, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiter.done():
                waiter.cancel()
        if waiter in done:
            waiter.result()
            return
        if self.failed.done():
            child = self.failed.result()
            raise ProcessFailed(
                f"{child.name} {describe_exit(child.last_exit)} while waiting for {what}; "
                f"last lines of {child.log_path}:\n{child.tail()}"
            )
        crashing = [c for c in self.children if c.last_exit is not None]
        why = "".join(
            f"\n{c.name} exited {c.restarts + 1} time(s), last {describe_exit(c.last_exit)}; last lines "
            f"of {c.log_path}:\n{c.tail()}"
            for c in crashing
        )
        raise ProcessFailed(f"timed out after {timeout:.0f}s waiting for {what}; logs are in {self.log_dir}{why}")

    async def stop(self, grace: float = 5.0) -> None:
        """Restart nothing more; SIGTERM every child's process group (newest first), SIGKILL what is left
        after `grace`, and the groups once more for stragglers a service itself spawned."""
        self._stopping.set()
        await asyncio.gather(*self._loops, return_exceptions=True)  # each ends at once (or after a spawn)
        for child in reversed(self.children):
            _signal_group(child, signal.SIGTERM)
        for child in reversed(self.children):
            if child.process is None:
                continue
            try:
                await asyncio.wait_for(child.process.wait(), grace)
            except TimeoutError:
                log.warning("process did not stop in time; killing it", process=child.name, pid=child.pid)
                _signal_group(child, signal.SIGKILL)
                await child.process.wait()
            _signal_group(child, signal.SIGKILL)
            RUNNING.labels(child.name).set(0)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    if child.process is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.process.pid, sig)
