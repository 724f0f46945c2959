"""A process started inside a running container's sandbox, as a container runtime's exec does.

Owns the `nsenter` command line (the container's user, mount, PID, network, IPC and UTS namespaces, its root
and work dir, the container's uid kept) and the process's standard streams: pipes, or a pseudo-terminal when a
TTY is asked for (made the process's controlling terminal with `setsid --ctty`, resized on request). The
caller (the kubelet's streaming server) moves bytes; this module knows nothing of WebSockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import signal
import struct
import termios
from collections.abc import AsyncIterator

from embedded.nodeagent.sandbox import WORK_DIR

NAMESPACES = ("--user", "--mount", "--pid", "--net", "--ipc", "--uts")
READ_CHUNK = 32 * 1024


def sandbox_init(bwrap_pid: int) -> int | None:
    """The container's PID 1 (bwrap's child in the new namespaces), whose namespaces an exec joins."""
    try:
        with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
            kids = f.read().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


def nsenter_argv(target: int, argv: list[str], workdir: str = WORK_DIR) -> list[str]:
    """`nsenter ... -- argv` joining `target`'s namespaces; `--preserve-credentials` keeps the caller's uid,
    which the sandbox's user namespace maps to the container's user."""
    return [
        "nsenter",
        f"--target={target}",
        *NAMESPACES,
        "--preserve-credentials",
        "--root",
        f"--wdns={workdir}",
        "--",
        *argv,
    ]


class ExecProcess:
    """One process in a container: write stdin, read output, wait for its exit code."""

    def __init__(self, proc: asyncio.subprocess.Process, master: int | None) -> None:
        self.proc = proc
        self.master = master  # the terminal's master side (None without a TTY)
        self._closed_stdin = False

    @classmethod
    async def start(cls, target: int, argv: list[str], env: dict[str, str], *, tty: bool, stdin: bool) -> ExecProcess:
        if tty:  # a session of its own inside the container, the terminal its controlling one
            master, slave = pty.openpty()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *nsenter_argv(target, ["setsid", "--ctty", "--wait", *argv]),
                    stdin=slave,
                    stdout=slave,
                    stderr=slave,
                    env=env,
                    start_new_session=True,
                )
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            return cls(proc, master)
        proc = await asyncio.create_subprocess_exec(
            *nsenter_argv(target, argv),
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        return cls(proc, None)

    async def write_stdin(self, data: bytes) -> None:
        if self.master is not None:
            await asyncio.to_thread(_write_all, self.master, data)
        elif self.proc.stdin is not None and not self._closed_stdin:
            self.proc.stdin.write(data)
            with contextlib.suppress(ConnectionError):
                await self.proc.stdin.drain()

    async def close_stdin(self) -> None:
        """End of input: EOF on the pipe; on a terminal, the EOF character (as a terminal's ^D)."""
        if self.master is not None:
            await asyncio.to_thread(_write_all, self.master, b"\x04")
        elif self.proc.stdin is not None and not self._closed_stdin:
            self._closed_stdin = True
            self.proc.stdin.close()

    def resize(self, width: int, height: int) -> None:
        if self.master is not None and width > 0 and height > 0:
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, 0, 0))

    async def output(self, stream: int) -> AsyncIterator[bytes]:
        """Chunks of stdout (1) or stderr (2); with a TTY, everything comes as stdout."""
        if self.master is not None:
            if stream == 1:
                async for chunk in _terminal_output(self.master):
                    yield chunk
            return
        reader = self.proc.stdout if stream == 1 else self.proc.stderr
        assert reader is not None
        while chunk := await reader.read(READ_CHUNK):
            yield chunk

    async def wait(self) -> int:
        code = await self.proc.wait()
        return 128 - code if code < 0 else code

    async def kill(self) -> None:
        """End the process and everything it started (its process group; on a terminal, the hangup that closing
        it sends to its session)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
        self.close()

    def close(self) -> None:
        if self.master is not None:
            with contextlib.suppress(OSError):
                os.close(self.master)
            self.master = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


async def _terminal_output(master: int) -> AsyncIterator[bytes]:
    """The terminal's output until every process holding it has closed it (EIO on the master)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes] = asyncio.Queue()

    def readable() -> None:
        try:
            data = os.read(master, READ_CHUNK)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(master)
        queue.put_nowait(data)

    loop.add_reader(master, readable)
    try:
        while chunk := await queue.get():
            yield chunk
    finally:
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(master)
