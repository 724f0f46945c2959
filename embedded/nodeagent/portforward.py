"""The kubelet's port-forward protocol (`portforward.k8s.io`) on a SPDY session, tunneled over a WebSocket.

Every connection kubectl forwards is two streams it opens: an error stream, then a data stream, both with the
headers `streamtype` (`error` or `data`), `port` and `requestid`. A stream whose `port` is missing, not a number
or 0, or whose `streamtype` is neither, is refused (the kubelet's messages); the two streams of a request id
make a pair, and a pair that is not complete within STREAM_CREATION_TIMEOUT gets "timed out waiting for
streams" on its error stream. A complete pair dials the port in the pod (the `dial` given, netnsdial.py on
the node) and copies bytes both ways: the client's FIN half-closes the pod's socket, the pod's end of output
ends the data stream (the client then has GRACE seconds to finish), a reset ends both. A port that cannot be
dialled gets `error forwarding port <port> to pod <name>_<namespace>, uid <uid>: <why>` on the error stream,
which kubectl prints. Both streams are closed when the forward ends, as the kubelet's handler does.

The API server relays the WebSocket (subprotocol `SPDY/3.1+portforward.k8s.io`) unchanged, so the SPDY frames
kubectl writes are read here; upstream's API server would unwrap them and upgrade to the kubelet with SPDY
itself, which no client can tell apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import WSMsgType, web

from embedded.nodeagent.spdysession import Session, Stream
from shared.logs import get_logger

log = get_logger(__name__)
PROTOCOL = "portforward.k8s.io"
WS_PROTOCOL = f"SPDY/3.1+{PROTOCOL}"  # the tunneling prefix kubectl (1.31+) adds for SPDY over WebSocket
STREAM_CREATION_TIMEOUT = 30.0  # the kubelet's default
GRACE = 1.0  # after the pod's side ends, how long the client's side may go on (containerd's)
READ_CHUNK = 32 * 1024
Dial = Callable[[int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
_connections = itertools.count(1)


@dataclass
class _Pair:
    request_id: str
    data: Stream | None = None
    error: Stream | None = None
    timer: asyncio.TimerHandle | None = None


def refusal(stream: Stream) -> str | None:
    """Why the kubelet refuses a stream with these headers, in its words (None: a valid stream)."""
    port = stream.header("port")
    if not port:
        return '"port" header is required'
    if not (port.isascii() and port.isdigit()):
        return f'unable to parse "{port}" as a port: strconv.ParseUint: parsing "{port}": invalid syntax'
    if int(port) > 65535:
        return f'unable to parse "{port}" as a port: strconv.ParseUint: parsing "{port}": value out of range'
    if int(port) < 1:
        return f'port "{port}" must be > 0'
    kind = stream.header("streamType")
    if not kind:
        return '"streamType" header is required'
    if kind not in ("error", "data"):
        return f'invalid stream type "{kind}"'
    return None


class PortForwarder:
    """The stream handler of one port-forward session: pairs streams and runs a forward per complete pair."""

    def __init__(self, dial: Dial, pod: str, uid: str, creation_timeout: float = STREAM_CREATION_TIMEOUT) -> None:
        self.dial = dial
        self.pod = pod  # <name>_<namespace>, the kubelet's full pod name
        self.uid = uid
        self.creation_timeout = creation_timeout
        self.conn = next(_connections)
        self._pairs: dict[str, _Pair] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def accept(self, stream: Stream) -> str | None:
        return refusal(stream)

    def opened(self, stream: Stream) -> None:
        request_id = stream.header("requestID")
        if not request_id:  # an old client: derive the id from the stream ids, as the kubelet does
            request_id = str(stream.id if stream.header("streamType") == "error" else stream.id - 2)
        pair = self._pairs.get(request_id)
        if pair is None:
            pair = self._pairs[request_id] = _Pair(request_id)
            loop = asyncio.get_running_loop()
            pair.timer = loop.call_later(self.creation_timeout, self._timed_out, pair)
        kind = stream.header("streamType")
        if getattr(pair, kind) is not None:
            self._spawn(
                self._print(pair, f"error processing stream for request {request_id}: {kind} stream already assigned")
            )
            return
        setattr(pair, kind, stream)
        if pair.data is not None and pair.error is not None:
            if pair.timer is not None:
                pair.timer.cancel()
            self._pairs.pop(request_id, None)
            self._spawn(self._forward(pair.data, pair.error))

    def _timed_out(self, pair: _Pair) -> None:
        self._pairs.pop(pair.request_id, None)
        self._spawn(self._print(pair, f"(conn={self.conn}, request={pair.request_id}) timed out waiting for streams"))

    async def _print(self, pair: _Pair, message: str) -> None:
        log.warning("port-forward stream error", pod=self.pod, error=message)
        if pair.error is not None:
            with contextlib.suppress(ConnectionError):
                await pair.error.write(message.encode())

    def _spawn(self, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(self, data: Stream, error: Stream) -> None:
        port = int(data.header("port"))
        try:
            try:
                reader, writer = await self.dial(port)
            except OSError as exc:
                message = f"error forwarding port {port} to pod {self.pod}, uid {self.uid}: {exc}"
                log.warning("port-forward failed", pod=self.pod, port=port, error=str(exc))
                with contextlib.suppress(ConnectionError):
                    await error.write(message.encode())
                return
            log.info("port-forward connection", pod=self.pod, port=port, stream=data.id)
            try:
                await copy_both(data, reader, writer)
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
        finally:
            await data.close()
            await error.close()

    async def close(self) -> None:
        for pair in self._pairs.values():
            if pair.timer is not None:
                pair.timer.cancel()
        self._pairs.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def copy_both(stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Bytes both ways between a data stream and the pod's socket, until the pod's side ends (then GRACE for
    the client's) or the stream is reset."""

    async def to_pod() -> None:
        with contextlib.suppress(OSError):
            while data := await stream.read():
                writer.write(data)
                await writer.drain()
            if not stream.was_reset and writer.can_write_eof():
                writer.write_eof()  # the client's FIN: the pod reads its end of input

    async def to_client() -> None:
        with contextlib.suppress(OSError):
            while chunk := await reader.read(READ_CHUNK):
                await stream.write(chunk)
        await stream.close()

    up, down = asyncio.create_task(to_pod()), asyncio.create_task(to_client())
    reset = asyncio.create_task(stream.reset_event.wait())
    try:
        await asyncio.wait([down, reset], return_when=asyncio.FIRST_COMPLETED)
        if not reset.done():
            await asyncio.wait([up, reset], timeout=GRACE, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (up, down, reset):
            task.cancel()
        await asyncio.gather(up, down, reset, return_exceptions=True)


async def serve(ws: web.WebSocketResponse, forwarder: PortForwarder) -> None:
    """One port-forward session on an accepted WebSocket: its binary messages are the SPDY byte stream."""
    session = Session(ws.send_bytes, forwarder)
    try:
        async for msg in ws:
            if msg.type != WSMsgType.BINARY:  # kubectl's tunnel refuses anything but binary messages too
                log.warning("port-forward: not a binary message", type=str(msg.type))
                break
            if not await session.feed(msg.data):
                break
    except ConnectionError:  # the client went away while a frame was being answered
        pass
    finally:
        session.close()
        await forwarder.close()
