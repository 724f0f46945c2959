"""IMEX daemon supervision for one domain on one node: start, signal on peer change, restart on death.

Owns the child process. Readiness comes from the daemon's stdout (`IMEX-SIM STATUS READY|NOT_READY`
lines, which the simulated daemon prints) or, for a daemon that prints nothing useful (the real
`nvidia-imex`), from a check command run every `check_interval` that must print `READY`
(`nvidia-imex-ctl -c {config} -q`). Every change is handed to `on_ready(bool)`. A daemon that exits
while not being stopped is restarted with backoff (0.1 s doubling to 5 s) and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from shared.logs import get_logger
from shared.tasks import cancelling

log = get_logger(__name__)

DEFAULT_COMMAND = f"{shlex.quote(sys.executable)} -m services.computedomain.imexd --config {{config}}"
_STOP_GRACE_S = 5.0


class ImexError(RuntimeError):
    """The daemon command is malformed or cannot be started."""


def render_command(template: str, config: Path) -> list[str]:
    """The argv for a command template; `{config}` becomes the config file's path."""
    try:
        argv = [part.replace("{config}", str(config)) for part in shlex.split(template)]
    except ValueError as exc:
        raise ImexError(f"IMEX command {template!r} cannot be parsed: {exc}") from None
    if not argv:
        raise ImexError("IMEX command is empty; set --imex-command (default: the simulated daemon)")
    return argv


def parse_signal(name: str) -> signal.Signals:
    try:
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except KeyError:
        raise ImexError(f"unknown signal {name!r}; use e.g. SIGHUP or SIGUSR1") from None


class ImexSupervisor:
    """One supervised IMEX daemon; `start()`, `reload()` on peer changes, `stop()`."""

    def __init__(
        self,
        *,
        name: str,
        command: str,
        config: Path,
        on_ready: Callable[[bool], Awaitable[None]],
        reload_signal: str = "SIGHUP",
        check_command: str = "",
        check_interval: float = 1.0,
        log_file: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = render_command(command, config)
        self.check_argv = render_command(check_command, config) if check_command else None
        self.check_interval = check_interval
        self.reload_signal = parse_signal(reload_signal)
        self.config = config
        self.log_file = log_file
        self._on_ready = on_ready
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.ready = False
        self.restarts = 0
        self.reloads = 0  # signals sent
        self._reload_waiters: list[asyncio.Future[None]] = []
        self.reloads_done = 0  # reloads the daemon reported (`IMEX-SIM RELOAD <n>`), this incarnation
        self._reported = asyncio.Condition()
        self._accepting = False  # the daemon has spoken: its signal handlers are installed
        self._pending_reload = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"imex-{self.name}")

    def reload(self) -> None:
        """Tell the daemon its peers changed (it re-reads names and redials).

        Until the daemon has printed its first line it may not have its signal handlers yet (and
        SIGHUP's default action ends a process), so the signal waits for that line."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        self.reloads += 1
        for waiter in self._reload_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._reload_waiters.clear()
        if not self._accepting:
            self._pending_reload = True
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(self.reload_signal)

    async def wait_signalled(self, count: int) -> None:
        """Until more than `count` reload signals have been sent in all (see `reloads`)."""
        while self.reloads <= count:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._reload_waiters.append(waiter)
            await waiter

    async def wait_reloaded(self, count: int) -> None:
        """Until the daemon has reported `count` reloads (the simulated daemon reports them)."""
        async with self._reported:
            await self._reported.wait_for(lambda: self.reloads_done >= count)

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._set_ready(False)

    async def _set_ready(self, ready: bool) -> None:
        if ready != self.ready:
            self.ready = ready
            try:
                await self._on_ready(ready)
            except Exception:  # noqa: BLE001 - a failed report must not end supervision
                log.exception("IMEX readiness report failed", daemon=self.name)

    async def _read_status(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        sink = self.log_file.open("ab") if self.log_file else None
        try:
            async for line in proc.stdout:
                if not self._accepting:
                    self._accepting = True
                    if self._pending_reload:
                        self._pending_reload = False
                        with contextlib.suppress(ProcessLookupError):
                            proc.send_signal(self.reload_signal)
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                if self.check_argv is None and line.startswith(b"IMEX-SIM STATUS "):
                    await self._set_ready(line.split()[2] == b"READY")
                elif line.startswith(b"IMEX-SIM RELOAD "):
                    async with self._reported:
                        self.reloads_done = int(line.split()[2])
                        self._reported.notify_all()
        finally:
            if sink is not None:
                sink.close()

    async def _check_loop(self) -> None:
        assert self.check_argv is not None
        while True:
            try:
                probe = await asyncio.create_subprocess_exec(
                    *self.check_argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
                out, _ = await asyncio.wait_for(probe.communicate(), 10.0)
                await self._set_ready(out == b"READY\n")
            except (OSError, TimeoutError):
                await self._set_ready(False)
            await asyncio.sleep(self.check_interval)

    def _ending(self) -> bool:
        """Stopped, or this task cancelled, even where a callee swallowed the CancelledError (see
        shared.tasks): a cancelled supervisor never restarts its daemon."""
        return self._stopping.is_set() or cancelling()

    async def _run(self) -> None:
        try:
            await self._supervise()
        finally:
            proc = self._proc
            self._proc = None
            if proc is not None and proc.returncode is None:
                # Cancelled rather than stopped (its owner's loop is closing): the daemon must not outlive it.
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    async def _supervise(self) -> None:
        backoff = 0.1
        while not self._ending():
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True)
            except OSError as exc:
                log.error("IMEX daemon cannot start", daemon=self.name, command=self.argv[0], error=str(exc))
                await self._wait_stop(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            self._proc = proc
            self.reloads_done = 0
            self._accepting = False
            self._pending_reload = False
            started = asyncio.get_running_loop().time()
            log.info("IMEX daemon started", daemon=self.name, pid=proc.pid, restarts=self.restarts)
            reader = asyncio.create_task(self._read_status(proc))
            checker = asyncio.create_task(self._check_loop()) if self.check_argv else None
            stop_wait = asyncio.create_task(self._stopping.wait())
            exited = asyncio.create_task(proc.wait())
            await asyncio.wait({exited, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            if checker is not None:
                checker.cancel()
            if not exited.done():
                await self._terminate(proc)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reader, 2.0)
            await self._set_ready(False)
            if self._ending():
                break
            self.restarts += 1
            if asyncio.get_running_loop().time() - started > 30.0:
                backoff = 0.1  # it ran a good while: this death is not a crash loop
            log.warning("IMEX daemon exited; restarting", daemon=self.name, code=proc.returncode,
                        restarts=self.restarts, backoff_s=backoff)
            await self._wait_stop(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _wait_stop(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _terminate(self, proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), _STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
