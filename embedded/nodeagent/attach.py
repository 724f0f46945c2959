"""`kubectl attach`, kubelet side: a running container's own standard streams, as the runtime's attach gives them.

Owns one attach session: the container's output from now on (every line it writes goes to its log and to each
attached session), its stdin when the container asks for one (`stdin: true`; with `stdinOnce`, closed when the
first session ends its input, as the runtime does). The session ends when the container exits or the client
leaves; attach reports Success either way, as the kubelet's ServeAttach does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any


class Attachment:
    """One client's view of a container's streams (remotecommand.Streams)."""

    def __init__(
        self, proc: asyncio.subprocess.Process, spec: dict[str, Any], leave: Callable[[asyncio.Queue[bytes]], None]
    ) -> None:
        self.proc = proc
        self.spec = spec
        self.lines: asyncio.Queue[bytes] = asyncio.Queue()  # b"" once the container has exited
        self._leave = leave

    async def write_stdin(self, data: bytes) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.write(data)
            try:
                await self.proc.stdin.drain()
            except ConnectionError:
                pass

    async def close_stdin(self) -> None:
        if self.spec.get("stdinOnce") and self.proc.stdin is not None:
            self.proc.stdin.close()

    def resize(self, width: int, height: int) -> None:
        """The container has no terminal of its own here: nothing to resize."""

    async def output(self, stream: int) -> AsyncIterator[bytes]:
        if stream != 1:  # the container's stderr is merged into its stdout (its log)
            return
        while chunk := await self.lines.get():
            yield chunk

    async def wait(self) -> int:
        await self.proc.wait()
        return 0

    def close(self) -> None:
        self._leave(self.lines)
