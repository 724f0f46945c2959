"""The remote command protocol over a WebSocket (`v5.channel.k8s.io`, and `v4.channel.k8s.io`), kubelet side.

Every binary message starts with its channel: 0 stdin, 1 stdout, 2 stderr, 3 the error channel (one
`metav1.Status` JSON when the command ends: Success, or Failure with reason NonZeroExitCode and the exit code
as the ExitCode cause), 4 terminal resize (`{"Width": w, "Height": h}`); v5 adds 255, the client's close of a
stream (`[255, 0]`: end of stdin). Owns serving one exec (or attach) on an accepted socket: input to the
process, its output out, its exit status last, then a normal close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from aiohttp import WSMsgType, web

from shared.logs import get_logger

log = get_logger(__name__)
V5, V4 = "v5.channel.k8s.io", "v4.channel.k8s.io"
PROTOCOLS = (V5, V4)
STDIN, STDOUT, STDERR, ERROR, RESIZE, CLOSE = 0, 1, 2, 3, 4, 255
DRAIN_SECONDS = 2.0  # output still read after the process exits (what it wrote just before)


class Streams(Protocol):
    """A running command's standard streams (execproc.ExecProcess, or an attached container)."""

    async def write_stdin(self, data: bytes) -> None: ...
    async def close_stdin(self) -> None: ...
    def resize(self, width: int, height: int) -> None: ...
    def output(self, stream: int) -> AsyncIterator[bytes]: ...
    async def wait(self) -> int: ...


def success() -> dict[str, Any]:
    return {"metadata": {}, "status": "Success"}


def exit_status(code: int) -> dict[str, Any]:
    """The error channel's message for a command that ended with `code`, as the kubelet writes it."""
    if code == 0:
        return success()
    return {
        "metadata": {},
        "status": "Failure",
        "message": f"command terminated with non-zero exit code: exit status {code}",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
    }


def failure(message: str, code: int = 500, reason: str = "InternalError") -> dict[str, Any]:
    return {"metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code}


async def send(ws: web.WebSocketResponse, channel: int, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        await ws.send_bytes(bytes([channel]) + data)


async def finish(ws: web.WebSocketResponse, status: dict[str, Any]) -> None:
    await send(ws, ERROR, json.dumps(status).encode())
    await ws.close()


async def _input(ws: web.WebSocketResponse, streams: Streams, stdin: bool) -> None:
    async for msg in ws:
        if msg.type != WSMsgType.BINARY or not msg.data:
            continue
        channel, data = msg.data[0], msg.data[1:]
        if channel == STDIN and stdin:
            if data:
                await streams.write_stdin(data)
        elif channel == RESIZE:
            with contextlib.suppress(ValueError, TypeError, AttributeError, OSError):
                size = json.loads(data)
                streams.resize(int(size.get("Width", 0)), int(size.get("Height", 0)))
        elif channel == CLOSE and ws.ws_protocol == V5 and data[:1] == bytes([STDIN]) and stdin:
            await streams.close_stdin()
    if stdin and ws.ws_protocol != V5:  # v4 has no close signal: the socket's end ends the input
        with contextlib.suppress(OSError):
            await streams.close_stdin()


async def _output(ws: web.WebSocketResponse, streams: Streams, stream: int, wanted: bool) -> None:
    async for chunk in streams.output(stream):
        if wanted:
            await send(ws, stream, chunk)


async def serve(
    ws: web.WebSocketResponse, streams: Streams, *, stdin: bool, stdout: bool, stderr: bool, tty: bool
) -> int | None:
    """Pump `streams` over `ws` until the command ends (its exit code is sent on the error channel and
    returned) or the client goes away (None: the caller ends the command)."""
    reader = asyncio.create_task(_input(ws, streams, stdin))
    pumps = [asyncio.create_task(_output(ws, streams, STDOUT, stdout))]
    if not tty:
        pumps.append(asyncio.create_task(_output(ws, streams, STDERR, stderr)))
    waiter = asyncio.create_task(streams.wait())
    try:
        await asyncio.wait([waiter, reader], return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            return None
        code = waiter.result()
        _, late = await asyncio.wait(pumps, timeout=DRAIN_SECONDS)
        for task in late:  # something the command started still holds its output open
            task.cancel()
        await finish(ws, exit_status(code))
        return code
    finally:
        tasks: list[asyncio.Task[Any]] = [reader, waiter, *pumps]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
