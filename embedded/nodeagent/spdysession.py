"""A SPDY/3.1 session, server side, over any byte transport (the kubelet emulator's: a WebSocket's binary
messages, as `kubectl port-forward` tunnels SPDY since Kubernetes 1.31).

Owns the streams the peer opens: a SYN_STREAM (odd id, above every earlier one) is offered to the handler, which
refuses it (RST_STREAM CANCEL, as apimachinery's server does) or takes it (SYN_REPLY with no headers, then the
handler is told it opened); data frames feed the stream, FIN ends its input, RST_STREAM ends it both ways; the
peer's PINGs are echoed; GOAWAY stops new streams. SETTINGS, WINDOW_UPDATE and HEADERS are read and ignored:
spdystream, kubectl's side, does no flow control. Frames are written whole, one per transport write, under one
lock so their header blocks are compressed in the order they are sent. A frame that breaks the protocol ends the
session with a GOAWAY saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol

from embedded.nodeagent import spdyframes as f
from shared.logs import get_logger

log = get_logger(__name__)
WRITE_CHUNK = 64 * 1024


class StreamHandler(Protocol):
    def accept(self, stream: Stream) -> str | None:
        """Why `stream` is refused, or None to take it."""

    def opened(self, stream: Stream) -> None:
        """`stream` was taken and its SYN_REPLY sent."""


class Stream:
    """One stream the peer opened: read its data, write ours, close our side (FIN) or reset both."""

    def __init__(self, session: Session, stream_id: int, headers: f.Headers) -> None:
        self.session = session
        self.id = stream_id
        self.headers = headers
        self.reset_event = asyncio.Event()  # either side reset it
        self.local_closed = False
        self.remote_closed = False
        self._input: asyncio.Queue[bytes] = asyncio.Queue()  # b"": the peer's FIN (or a reset)
        self._eof = False

    def header(self, name: str) -> str:
        values = self.headers.get(name.lower()) or [""]
        return values[0]

    @property
    def was_reset(self) -> bool:
        return self.reset_event.is_set()

    async def read(self) -> bytes:
        """The peer's next data; b"" once it has sent FIN or the stream was reset."""
        if self._eof:
            return b""
        data = await self._input.get()
        if not data:
            self._eof = True
        return data

    async def write(self, data: bytes) -> None:
        if self.was_reset or self.local_closed:
            raise ConnectionResetError(f"stream {self.id} is closed")
        view = memoryview(data)
        while view:
            await self.session.send(f.DataFrame(self.id, bytes(view[:WRITE_CHUNK])))
            view = view[WRITE_CHUNK:]

    async def close(self) -> None:
        """Our side is done (an empty data frame with FIN)."""
        if self.was_reset or self.local_closed:
            return
        self.local_closed = True
        with contextlib.suppress(ConnectionError):
            await self.session.send(f.DataFrame(self.id, b"", f.FLAG_FIN))
        self.session.forget_if_done(self)

    async def reset(self, status: int = f.CANCEL) -> None:
        if self.was_reset:
            return
        self.ended_by_reset()
        with contextlib.suppress(ConnectionError):
            await self.session.send(f.RstStream(self.id, status))

    def deliver(self, data: bytes, fin: bool) -> None:
        if self.remote_closed:
            return
        if data:
            self._input.put_nowait(data)
        if fin:
            self.remote_closed = True
            self._input.put_nowait(b"")
            self.session.forget_if_done(self)

    def ended_by_reset(self) -> None:
        self.reset_event.set()
        if not self.remote_closed:
            self.remote_closed = True
            self._input.put_nowait(b"")
        self.session.streams.pop(self.id, None)


class Session:
    """Frames in through `feed`, frames out through `send_bytes` (one call per frame)."""

    def __init__(self, send_bytes: Callable[[bytes], Awaitable[None]], handler: StreamHandler) -> None:
        self._send_bytes = send_bytes
        self._handler = handler
        self._encoder = f.Encoder()
        self._decoder = f.Decoder()
        self._lock = asyncio.Lock()
        self.streams: dict[int, Stream] = {}
        self.last_stream_id = 0
        self.gone_away = False
        self.closed = False

    async def send(self, frame: f.Frame) -> None:
        if self.closed:
            raise ConnectionResetError("the SPDY session is closed")
        async with self._lock:
            await self._send_bytes(self._encoder.encode(frame))

    def forget_if_done(self, stream: Stream) -> None:
        if stream.local_closed and stream.remote_closed:
            self.streams.pop(stream.id, None)

    async def feed(self, data: bytes) -> bool:
        """Handle the frames `data` completes; False when the session must end (a frame broke the protocol:
        a GOAWAY saying so was sent)."""
        try:
            frames = self._decoder.feed(data)
        except f.FrameError as exc:
            log.warning("SPDY protocol error", error=str(exc))
            with contextlib.suppress(ConnectionError):
                await self.send(f.GoAway(self.last_stream_id, f.GOAWAY_PROTOCOL_ERROR))
            return False
        for frame in frames:
            await self._handle(frame)
        return True

    async def _handle(self, frame: f.Frame) -> None:
        if isinstance(frame, f.SynStream):
            await self._open(frame)
        elif isinstance(frame, f.DataFrame):
            stream = self.streams.get(frame.stream_id)
            if stream is not None:  # data for a stream already ended (reset, say) is dropped, as spdystream does
                stream.deliver(frame.data, bool(frame.flags & f.FLAG_FIN))
        elif isinstance(frame, f.RstStream):
            stream = self.streams.get(frame.stream_id)
            if stream is not None:
                stream.ended_by_reset()
        elif isinstance(frame, f.Ping):
            if frame.ping_id % 2 == 1:  # the client's (odd ids); a server's own would be even
                await self.send(frame)
        elif isinstance(frame, f.GoAway):
            self.gone_away = True
        # SETTINGS, WINDOW_UPDATE, HEADERS, a SYN_REPLY (this side opens no streams): nothing to do

    async def _open(self, frame: f.SynStream) -> None:
        if frame.stream_id % 2 == 0 or frame.stream_id <= self.last_stream_id:
            log.warning("SPDY stream id out of order", stream=frame.stream_id, last=self.last_stream_id)
            await self.send(f.RstStream(frame.stream_id, f.PROTOCOL_ERROR))
            return
        self.last_stream_id = frame.stream_id
        if self.gone_away:
            await self.send(f.RstStream(frame.stream_id, f.REFUSED_STREAM))
            return
        stream = Stream(self, frame.stream_id, frame.headers)
        why = self._handler.accept(stream)
        if why is not None:
            log.info("SPDY stream refused", stream=frame.stream_id, reason=why)
            await self.send(f.RstStream(frame.stream_id, f.CANCEL))
            return
        self.streams[stream.id] = stream
        if frame.flags & f.FLAG_UNIDIRECTIONAL:
            stream.local_closed = True
        await self.send(f.SynReply(stream.id, {}))
        if frame.flags & f.FLAG_FIN:
            stream.deliver(b"", True)
        self._handler.opened(stream)

    def close(self) -> None:
        """The transport is gone: every stream ends as if reset."""
        self.closed = True
        for stream in list(self.streams.values()):
            stream.ended_by_reset()
        self.streams.clear()
