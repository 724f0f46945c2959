"""IMEX daemon supervision for one domain on one node: start, signal or restart on peer change, restart on death.

Owns the child process. Readiness comes from the daemon's stdout (`IMEX-SIM STATUS READY|NOT_READY`
lines, which the simulated daemon prints) or, for a daemon that prints nothing useful (the real
`nvidia-imex`), from a check command run every `check_interval` that must print `READY`
(`nvidia-imex-ctl -c {config} -q`). Every change is handed to `on_ready(bool)`. A daemon that exits
while not being stopped is restarted with backoff (shared.backoff: 0.1 s doubling to 5 s) and counted; `restart()`
(peers by IP) replaces it at once without counting.
Reload signals: sent only once the daemon catches the signal (its /proc SigCgt mask; the default
action of SIGHUP and SIGUSR1 ends a process), at most one per `signal_spacing` seconds (nvidia-imex
ignores a SIGUSR1 within 5 s of the last one): changes inside that window are coalesced into one
signal at its end. No daemon outlives the supervisor: a pid record per daemon and a parent-death
signal (services.computedomain.orphans).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from prometheus_client import Counter, Gauge

from services.computedomain import orphans
from shared.backoff import Backoff
from shared.logs import get_logger
from shared.tasks import cancel_and_wait, cancelling, raise_if_cancelling

log = get_logger(__name__)
IMEX_RUNNING = Gauge("gpu_dra_imex_daemons_running", "IMEX daemons this agent runs now")
IMEX_RESTARTS = Counter("gpu_dra_imex_daemon_restarts", "IMEX daemons restarted after they died")
IMEX_READY = Gauge(
    "gpu_dra_imex_daemons_ready",
    "IMEX daemons of this agent that report READY (the rest of gpu_dra_imex_daemons_running are starting or not ready)",
)

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
        raise ImexError("IMEX command is empty; set --imex-command or leave it unset for the default daemon")
    return argv


def parse_signal(name: str) -> signal.Signals:
    try:
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except KeyError:
        raise ImexError(f"unknown signal {name!r}; use e.g. SIGUSR1 or SIGHUP") from None


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (/proc/<pid>/status SigCgt); True where /proc
    cannot tell (not Linux), False once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    for line in text.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    return True


class DaemonSupervisor(Protocol):
    """What the agent needs of a domain's daemon: ImexSupervisor, or a stand-in built with its keywords."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def reload(self) -> None: ...
    def restart(self) -> None: ...


class ImexSupervisor:
    """One supervised IMEX daemon; `start()`, `reload()` or `restart()` on peer changes, `stop()`."""

    def __init__(
        self,
        *,
        name: str,
        command: str,
        config: Path,
        on_ready: Callable[[bool], Awaitable[None]],
        reload_signal: str = "SIGUSR1",
        signal_spacing: float = 0.0,
        check_command: str = "",
        check_interval: float = 1.0,
        env: dict[str, str] | None = None,
        log_file: Path | None = None,
        pid_file: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = render_command(command, config)
        self.check_argv = render_command(check_command, config) if check_command else None
        self.check_interval = check_interval
        self.reload_signal = parse_signal(reload_signal)
        self.signal_spacing = signal_spacing
        self.config = config
        self.env = {**os.environ, **env} if env else None
        self.log_file = log_file
        self.pid_file = pid_file
        self._on_ready = on_ready
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._restart = asyncio.Event()
        self._reload_wanted = asyncio.Event()
        self.ready = False
        self.restarts = 0  # deaths, not counting `restart()`
        self.replaced = 0  # `restart()`s done
        self.reloads = 0  # signals sent
        self._reload_waiters: list[asyncio.Future[None]] = []
        self.reloads_done = 0  # reloads the daemon reported (`IMEX-SIM RELOAD <n>`), this incarnation
        self._reported = asyncio.Condition()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"imex-{self.name}")

    def reload(self) -> None:
        """Tell the daemon its peers changed (it re-resolves the names and redials); sent by `_signaller`."""
        if self.pid is not None:
            self._reload_wanted.set()

    def restart(self) -> None:
        """Replace the daemon by a fresh one (it reads its nodes file only at start)."""
        if self._task is not None:
            self._restart.set()

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
            (IMEX_READY.inc if ready else IMEX_READY.dec)()
            try:
                await self._on_ready(ready)
            except Exception:  # noqa: BLE001 - a failed report must not end supervision
                log.exception("IMEX readiness report failed", daemon=self.name)

    async def _signaller(self, proc: asyncio.subprocess.Process) -> None:
        loop = asyncio.get_running_loop()
        last = -self.signal_spacing
        while True:
            await self._reload_wanted.wait()
            while not await asyncio.to_thread(catches, proc.pid, self.reload_signal):
                if proc.returncode is not None:
                    return
                await asyncio.sleep(0.02)  # the daemon is still starting; its handlers have no event
            wait = last + self.signal_spacing - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)  # changes meanwhile ride on this one signal
            self._reload_wanted.clear()
            if proc.returncode is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(self.reload_signal)
            last = loop.time()
            self.reloads += 1
            for waiter in self._reload_waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self._reload_waiters.clear()

    async def _read_status(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        sink = self.log_file.open("ab") if self.log_file else None
        try:
            async for line in proc.stdout:
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
            raise_if_cancelling()  # asked to stop while a probe's wait_for swallowed it
            try:
                probe = await asyncio.create_subprocess_exec(
                    *self.check_argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=self.env
                )
                try:
                    out, _ = await asyncio.wait_for(probe.communicate(), 10.0)
                finally:
                    if probe.returncode is None:  # timed out, or the daemon is being stopped
                        with contextlib.suppress(ProcessLookupError):
                            probe.kill()
                        await probe.wait()
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
            if self.ready:  # cancelled while ready: no report to make, but the gauge must not keep it
                self.ready = False
                IMEX_READY.dec()
            proc = self._proc
            self._proc = None
            if proc is not None and proc.returncode is None:
                # Cancelled rather than stopped (its owner's loop is closing): the daemon must not outlive it.
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    async def _spawn(self) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            *orphans.with_parent_death_signal(self.argv),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
        )
        if self.pid_file is not None:
            await asyncio.to_thread(orphans.record, self.pid_file, proc.pid, self.argv[0])
        return proc

    async def _supervise(self) -> None:
        backoff = Backoff(initial_s=0.1, cap_s=5.0, stable_after_s=30.0)
        while not self._ending():
            # Cleared before the spawn, not after: the new daemon reads the files after this point, and a
            # restart() or reload() asked for while it spawns must still reach it (lost, the daemon would
            # keep a nodes file older than the request).
            self._restart.clear()
            self._reload_wanted.clear()
            try:
                proc = await self._spawn()
            except OSError as exc:
                log.error("IMEX daemon cannot start", daemon=self.name, command=self.argv[0], error=str(exc))
                await self._wait_stop(backoff.next())
                continue
            self._proc = proc
            self.reloads_done = 0
            started = asyncio.get_running_loop().time()
            log.info("IMEX daemon started", daemon=self.name, pid=proc.pid, restarts=self.restarts)
            IMEX_RUNNING.inc()
            helpers = [asyncio.create_task(self._read_status(proc)), asyncio.create_task(self._signaller(proc))]
            if self.check_argv:
                helpers.append(asyncio.create_task(self._check_loop()))
            waits = [asyncio.create_task(self._stopping.wait()), asyncio.create_task(self._restart.wait())]
            exited = asyncio.create_task(proc.wait())
            try:
                await asyncio.wait({exited, *waits}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                # cancel_and_wait, not cancel + gather: a check probe's wait_for can swallow the
                # cancellation (Python 3.11), and a gather would then wait for ever.
                await cancel_and_wait([*waits, *helpers[1:]])
            replaced = not exited.done() and self._restart.is_set() and not self._ending()
            if not exited.done():
                await self._terminate(proc)
            IMEX_RUNNING.dec()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(helpers[0], 2.0)
            if self.pid_file is not None:
                await asyncio.to_thread(orphans.forget, self.pid_file)
            await self._set_ready(False)
            if self._ending():
                break
            if replaced:
                self.replaced += 1
                log.info("IMEX daemon restarted for new peers", daemon=self.name, replaced=self.replaced)
                continue
            self.restarts += 1
            IMEX_RESTARTS.inc()
            backoff.ran(asyncio.get_running_loop().time() - started)  # a good while: not a crash loop
            delay = backoff.next()
            log.warning(
                "IMEX daemon exited; restarting",
                daemon=self.name,
                code=proc.returncode,
                restarts=self.restarts,
                backoff_s=delay,
            )
            await self._wait_stop(delay)

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
