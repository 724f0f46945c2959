"""One MPS control daemon as a process: `nvidia-cuda-mps-control -d` from the driver root, commands over
its control pipe, readiness, and stop.

Facts (NVIDIA's MPS documentation and its DRA driver): the daemon starts with `-d` and the env
`CUDA_VISIBLE_DEVICES` (the GPUs it serves), `CUDA_MPS_PIPE_DIRECTORY` (its control socket and its pid
file `nvidia-cuda-mps-control.pid`) and `CUDA_MPS_LOG_DIRECTORY` (control.log, server.log); `-d`
returns once the daemon has forked. Commands are lines on the stdin of `nvidia-cuda-mps-control` run
with the same env: `set_default_active_thread_percentage N`, `set_default_device_pinned_mem_limit
<dev> <N>M`, `get_default_active_thread_percentage`, `quit`. `<dev>` is sent as the GPU's UUID, as
NVIDIA's DRA driver does, never as an index: an index would depend on the order CUDA enumerates
CUDA_VISIBLE_DEVICES in. The daemon is known by its pid file and checked to be ours (its command
line names nvidia-cuda-mps-control and its env names our pipe dir) before anything signals it, so a
pid reused after a reboot is never killed.

Not done: chroot into the driver root (NVIDIA's daemon pod does when the root has a shell); the
binaries run through the root's loader or with its library dirs instead (shared.drivertools). Open
on a node whose driver root is the whole host root: the `nvidia-cuda-mps-server` the daemon execs
for the first client starts under this container's loader and does not see the root's libraries;
a chroot (the container is privileged) is the fix, left for a GPU machine to verify. The daemon runs
in discovery's container: a restart of that container ends it (see MpsManager.reconcile).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Protocol

from shared.drivertools import DriverTools, ToolError
from shared.logs import get_logger

log = get_logger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
START_LOG = "control-start.log"  # what `-d` printed (the daemon's own logs are control.log, server.log)
READY_QUERY = "get_default_active_thread_percentage"


class Daemon(Protocol):
    """What process control needs of a daemon record."""

    @property
    def daemon_id(self) -> str: ...
    @property
    def gpu_uuids(self) -> list[str]: ...
    @property
    def pipe_dir(self) -> str: ...
    @property
    def log_dir(self) -> str: ...
    @property
    def pid(self) -> int: ...


def _alive(pid: int) -> bool:
    """A live process (a zombie is not: it has exited and only waits to be reaped)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _is_ours(pid: int, pipe_dir: str) -> bool:
    """Process `pid` is alive, is an MPS control daemon, and serves `pipe_dir` (blocking: /proc reads)."""
    if not _alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if not any(os.path.basename(arg) == CONTROL.encode() for arg in cmdline):
        return False
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return True  # not readable here (another user): the command line has to do
    return f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode() in environ


def _read_pid(pipe_dir: str) -> int:
    try:
        return int(Path(pipe_dir, PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return 0


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return ""


class MpsControl:
    """Start, command, find and stop MPS control daemons with the driver root's binaries."""

    def __init__(self, tools: DriverTools, *, ready_timeout: float = 10.0, stop_timeout: float = 5.0):
        self.tools = tools
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout

    @staticmethod
    def env(d: Daemon) -> dict[str, str]:
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(d.gpu_uuids),
            "CUDA_MPS_PIPE_DIRECTORY": d.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": d.log_dir,
        }

    async def running_pid(self, d: Daemon) -> int:
        """The pid of `d`'s daemon if it runs (from its pid file, else the one recorded), else 0."""
        for pid in dict.fromkeys((await asyncio.to_thread(_read_pid, d.pipe_dir), d.pid)):
            if pid and await asyncio.to_thread(_is_ours, pid, d.pipe_dir):
                return pid
        return 0

    async def spawn(self, d: Daemon) -> int:
        """`nvidia-cuda-mps-control -d`; returns the daemon's pid once its pid file names a live daemon."""
        start_log = Path(d.log_dir) / START_LOG
        res = await self.tools.run(CONTROL, ["-d"], env=self.env(d), output=start_log, new_session=True)
        if res.returncode != 0:
            detail = await asyncio.to_thread(_tail, start_log) or "no output"
            raise ToolError(
                "failed", f"{CONTROL} -d for MPS daemon {d.daemon_id} failed (exit {res.returncode}): {detail}"
            )
        deadline = time.monotonic() + self.ready_timeout
        while True:  # another process's effect: a bounded poll
            pid = await self.running_pid(d)
            if pid:
                log.info("MPS control daemon started", daemon=d.daemon_id, pid=pid, gpus=d.gpu_uuids)
                return pid
            if time.monotonic() >= deadline:
                raise ToolError(
                    "timeout",
                    f"{CONTROL} -d returned but no daemon wrote {d.pipe_dir}/{PID_FILE} "
                    f"within {self.ready_timeout:g}s; see {d.log_dir}/control.log",
                )
            await asyncio.sleep(0.05)

    async def command(self, d: Daemon, line: str) -> str:
        """Send one command line over the daemon's control pipe; its answer (ToolError if refused)."""
        res = await self.tools.run(CONTROL, [], stdin=line + "\n", env=self.env(d))
        if res.returncode != 0:
            detail = (res.stderr or res.stdout).strip() or "no output"
            raise ToolError(
                "failed",
                f"MPS control command {line!r} for daemon {d.daemon_id} failed (exit {res.returncode}): {detail}",
            )
        return res.stdout.strip()

    async def _gone(self, pid: int, pipe_dir: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while await asyncio.to_thread(_is_ours, pid, pipe_dir):  # another process's exit: a bounded poll
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def stop(self, d: Daemon) -> bool:
        """`quit` over the control pipe, then SIGTERM and SIGKILL after a bound. False if none was running."""
        pid = await self.running_pid(d)
        if not pid:
            return False
        try:
            await self.command(d, "quit")
        except ToolError as exc:
            log.warning("MPS quit refused; signalling the daemon", daemon=d.daemon_id, pid=pid, error=str(exc))
        if await self._gone(pid, d.pipe_dir, self.stop_timeout):
            log.info("MPS control daemon stopped", daemon=d.daemon_id, pid=pid)
            return True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            log.warning("MPS control daemon still running; signalling it", daemon=d.daemon_id, pid=pid, signal=sig.name)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            if await self._gone(pid, d.pipe_dir, 2.0):
                return True
        raise ToolError(
            "timeout",
            f"MPS control daemon {d.daemon_id} (pid {pid}) survived quit, SIGTERM and SIGKILL; check the node",
        )
