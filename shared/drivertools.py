"""Running the driver root's own binaries (nvidia-smi, nvidia-cuda-mps-control, ...) from this process.

Owns where a binary is (`DriverRoot.find_binary`), how it is started, and a bounded run: an asyncio
subprocess killed when it outlives its timeout. Nothing here blocks the event loop.

How: the driver root's library dirs must come first, but a driver root that is a whole host root
(`/` mounted at /driver-root) also holds the host's C library, and that libc under this container's
dynamic loader crashes or fails on symbol versions. So
  - an ELF binary whose loader (PT_INTERP) exists under the root runs through that loader:
    `<root>/lib64/ld-linux-x86-64.so.2 --library-path <root's lib dirs> <binary> ARGS` (host loader,
    host libc, driver libraries: one consistent set);
  - anything else (a root with only the driver's files, as on GKE, or a script) runs directly with
    LD_LIBRARY_PATH = the root's library dirs, leaving out any dir that holds a libc.so.6.
The root's binary dirs go first on PATH either way, so a tool that starts a sibling (as
`nvidia-cuda-mps-control` starts `nvidia-cuda-mps-server`) finds the driver's one. NVIDIA's MPS pod
chroots into the driver root instead; this process does not (see docs of services.discovery.mpsdaemon).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from shared.driverroot import BINARY_DIRS, DriverRoot
from shared.logs import get_logger

log = get_logger(__name__)

DEFAULT_TIMEOUT_S = 30.0


class ToolError(RuntimeError):
    """A driver binary is missing, failed or timed out; the message names the command and the fix.

    `kind` is "missing", "failed" or "timeout"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


_PT_INTERP = 3


def read_interp(path: str | Path) -> str:
    """The program interpreter (PT_INTERP) of a 64-bit little-endian ELF executable; "" for anything else."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return ""
            phoff = struct.unpack_from("<Q", head, 32)[0]
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            if phentsize < 56 or phnum > 512:
                return ""
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for i in range(min(phnum, len(table) // phentsize)):
                p_type, _flags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
                if p_type == _PT_INTERP and 0 < p_filesz < 4096:
                    f.seek(p_offset)
                    return f.read(p_filesz).split(b"\0", 1)[0].decode("utf-8", "replace")
    except (OSError, struct.error):
        return ""
    return ""


def _holds_libc(directory: Path) -> bool:
    return (directory / "libc.so.6").exists()


@dataclass
class ToolResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


@dataclass
class DriverTools:
    """The binaries of one driver root, run with its libraries."""

    root: DriverRoot
    timeout: float = DEFAULT_TIMEOUT_S
    _launches: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls, driver_root: str = "", container_driver_root: str = "", timeout: float = DEFAULT_TIMEOUT_S
    ) -> DriverTools:
        return cls(DriverRoot.of(driver_root or "/", container_driver_root), timeout)

    def command(self, name: str) -> tuple[list[str], dict[str, str]]:
        """(argv prefix, env additions) that start `name` (blocking: file lookups; `launch` is the async,
        cached form). Long-running daemons (nvidia-imex) are started from this too."""
        found = self.root.find_binary(name)
        if not found:
            raise ToolError(
                "missing",
                f"{name} not found under driver root {self.root.local('/')} (looked in "
                f"{', '.join(BINARY_DIRS)}); install the NVIDIA driver's utilities there or "
                "point --driver-root at the root that has them",
            )
        exe = str(self.root.local(found))
        bins = [str(self.root.local(d)) for d in BINARY_DIRS]
        path = os.environ.get("PATH", "")
        env = {"PATH": ":".join([*bins, path] if path else bins)}
        dirs = [self.root.local(d) for d in self.root.library_dirs()]
        interp = read_interp(exe)
        loader = self.root.local(interp) if interp else None
        if loader is not None and loader.is_file():
            return [str(loader), "--library-path", ":".join(str(d) for d in dirs), exe], env
        current = os.environ.get("LD_LIBRARY_PATH", "")
        usable = [str(d) for d in dirs if not _holds_libc(d)]
        if usable or current:
            env["LD_LIBRARY_PATH"] = ":".join([*usable, current] if current else usable)
        return [exe], env

    async def launch(self, name: str) -> tuple[list[str], dict[str, str]]:
        """How `name` is started: (argv prefix, env additions); ToolError "missing" if the root has none."""
        if name not in self._launches:
            self._launches[name] = await asyncio.to_thread(self.command, name)
        argv, env = self._launches[name]
        return list(argv), dict(env)

    async def has(self, name: str) -> bool:
        try:
            await self.launch(name)
        except ToolError:
            return False
        return True

    async def run(
        self,
        name: str,
        args: list[str],
        *,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        output: Path | None = None,
        new_session: bool = False,
    ) -> ToolResult:
        """Run `name args` to its exit, at most `timeout` seconds (then it is killed: ToolError "timeout").

        `output`: a file that takes stdout and stderr instead of pipes, for a command whose children
        keep running (a daemon that forks must not hold our pipes open). A non-zero exit is returned,
        not raised: callers say what it means."""
        prefix, tool_env = await self.launch(name)
        argv = [*prefix, *args]
        limit = self.timeout if timeout is None else timeout
        sink: IO[bytes] | None = None
        try:
            if output is not None:
                sink = await asyncio.to_thread(open, output, "ab")
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=sink if sink is not None else asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT if sink is not None else asyncio.subprocess.PIPE,
                env={**os.environ, **tool_env, **(env or {})},
                start_new_session=new_session,
            )
        except OSError as exc:
            raise ToolError("failed", f"cannot run {' '.join(argv)}: {exc}") from exc
        finally:
            if sink is not None:
                sink.close()
        try:
            async with asyncio.timeout(limit):
                out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
        except TimeoutError:
            log.warning("driver tool timed out; killing it", command=" ".join(argv), timeout_s=limit)
            raise ToolError(
                "timeout",
                f"{' '.join([name, *args])} did not finish within {limit:g}s and was "
                "killed; check the driver (nvidia-smi -q) and retry",
            ) from None
        finally:
            if proc.returncode is None:  # timed out or cancelled: never leave it running
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        return ToolResult(
            argv,
            proc.returncode if proc.returncode is not None else -1,
            (out or b"").decode(errors="replace"),
            (err or b"").decode(errors="replace"),
        )


__all__ = ["DEFAULT_TIMEOUT_S", "DriverTools", "ToolError", "ToolResult", "read_interp"]
