"""Running the driver root's own binaries (nvidia-smi, nvidia-cuda-mps-control, ...) from this process.

Owns where a binary is (`DriverRoot.find_binary`), the environment it runs with (the driver root's
library dirs on LD_LIBRARY_PATH and its binary dirs first on PATH, so a tool that starts a sibling,
as `nvidia-cuda-mps-control` starts `nvidia-cuda-mps-server`, finds the driver's one), and a bounded
run: an asyncio subprocess killed when it outlives its timeout. Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
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
    _paths: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, driver_root: str = "", container_driver_root: str = "",
           timeout: float = DEFAULT_TIMEOUT_S) -> DriverTools:
        return cls(DriverRoot.of(driver_root or "/", container_driver_root), timeout)

    def _find(self, name: str) -> str:
        found = self.root.find_binary(name)
        if not found:
            raise ToolError("missing", f"{name} not found under driver root {self.root.local('/')} (looked in "
                                       f"{', '.join(BINARY_DIRS)}); install the NVIDIA driver's utilities there or "
                                       "point --driver-root at the root that has them")
        return str(self.root.local(found))

    async def path(self, name: str) -> str:
        """Where this process runs `name` from (ToolError "missing" if the root has none)."""
        if name not in self._paths:
            self._paths[name] = await asyncio.to_thread(self._find, name)
        return self._paths[name]

    async def has(self, name: str) -> bool:
        try:
            await self.path(name)
        except ToolError:
            return False
        return True

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment with the driver root's libraries and binaries first, plus `extra`."""
        env = dict(os.environ)
        env.update(self.root.library_path_env())
        bins = [str(self.root.local(d)) for d in BINARY_DIRS]
        env["PATH"] = ":".join([*bins, env["PATH"]] if env.get("PATH") else bins)
        env.update(extra or {})
        return env

    async def run(self, name: str, args: list[str], *, stdin: str | None = None, env: dict[str, str] | None = None,
                  timeout: float | None = None, output: Path | None = None,
                  new_session: bool = False) -> ToolResult:
        """Run `name args` to its exit, at most `timeout` seconds (then it is killed: ToolError "timeout").

        `output`: a file that takes stdout and stderr instead of pipes, for a command whose children
        keep running (a daemon that forks must not hold our pipes open). A non-zero exit is returned,
        not raised: callers say what it means."""
        exe = await self.path(name)
        argv = [exe, *args]
        limit = self.timeout if timeout is None else timeout
        sink: IO[bytes] | None = None
        try:
            if output is not None:
                sink = await asyncio.to_thread(open, output, "ab")
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=sink if sink is not None else asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT if sink is not None else asyncio.subprocess.PIPE,
                env=self.env(env), start_new_session=new_session)
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
            raise ToolError("timeout", f"{' '.join([name, *args])} did not finish within {limit:g}s and was "
                                       "killed; check the driver (nvidia-smi -q) and retry") from None
        finally:
            if proc.returncode is None:  # timed out or cancelled: never leave it running
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        return ToolResult(argv, proc.returncode if proc.returncode is not None else -1,
                          (out or b"").decode(errors="replace"), (err or b"").decode(errors="replace"))


__all__ = ["DEFAULT_TIMEOUT_S", "DriverTools", "ToolError", "ToolResult"]
