"""The kubelet emulator's port-forward protocol on a SPDY session (spdysession.py, portforward.py), driven frame
by frame as kubectl's spdystream drives it, against a real TCP server on the host standing in for the pod."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from embedded.nodeagent import netnsdial, portforward
from embedded.nodeagent import spdyframes as f
from embedded.nodeagent.spdysession import Session, Stream

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class Client:
    """kubectl's side: frames out through the session, frames back from what the session sends."""

    def __init__(self, dial: portforward.Dial, creation_timeout: float = 30.0) -> None:
        self.encoder, self.decoder = f.Encoder(), f.Decoder()
        self.frames: asyncio.Queue[f.Frame] = asyncio.Queue()
        self.forwarder = portforward.PortForwarder(dial, "web_default", "uid-1", creation_timeout)
        self.session = Session(self._receive, self.forwarder)

    async def _receive(self, data: bytes) -> None:
        for frame in self.decoder.feed(data):
            self.frames.put_nowait(frame)

    async def send(self, *frames: f.Frame) -> bool:
        return await self.session.feed(b"".join(self.encoder.encode(frame) for frame in frames))

    async def next(self) -> f.Frame:
        return await asyncio.wait_for(self.frames.get(), 10)

    async def pair(self, request: int, port: int, first: int) -> None:
        """Open the error stream then the data stream of one forwarded connection; both are answered."""
        headers = {"port": [str(port)], "requestid": [str(request)]}
        await self.send(f.SynStream(first, {"streamtype": ["error"], **headers}))
        assert await self.next() == f.SynReply(first, {})
        await self.send(f.DataFrame(first, b"", f.FLAG_FIN))  # kubectl writes nothing on the error stream
        await self.send(f.SynStream(first + 2, {"streamtype": ["data"], **headers}))
        assert await self.next() == f.SynReply(first + 2, {})

    async def read_until_fin(self, wanted: set[int]) -> dict[int, bytes]:
        """Data per stream until each stream in `wanted` has sent FIN."""
        got: dict[int, bytes] = {}
        while wanted:
            frame = await self.next()
            assert isinstance(frame, f.DataFrame), frame
            if frame.data:
                got[frame.stream_id] = got.get(frame.stream_id, b"") + frame.data
            if frame.flags & f.FLAG_FIN:
                wanted.discard(frame.stream_id)
        return got

    async def close(self) -> None:
        self.session.close()
        await self.forwarder.close()


@pytest.fixture
async def echo() -> AsyncIterator[int]:
    """A server that answers `you said: <everything it read>` once its input ends, then closes."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"you said: " + await reader.read())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def local(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        return await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        raise netnsdial.DialError(f"dial tcp4 127.0.0.1:{port}: connect: connection refused") from None


async def test_a_pair_of_streams_forwards_both_ways_and_both_close(echo: int) -> None:
    client = Client(local)
    try:
        await client.pair(0, echo, 1)
        await client.send(f.DataFrame(3, b"hello "), f.DataFrame(3, b"pod", f.FLAG_FIN))  # FIN: the input ends
        assert await client.read_until_fin({1, 3}) == {3: b"you said: hello pod"}  # no error, both closed
    finally:
        await client.close()


async def test_two_connections_at_once_each_get_their_own_answer(echo: int) -> None:
    client = Client(local)
    try:
        await client.pair(0, echo, 1)
        await client.pair(1, echo, 5)
        await client.send(f.DataFrame(7, b"second", f.FLAG_FIN))
        assert await client.read_until_fin({5, 7}) == {7: b"you said: second"}
        await client.send(f.DataFrame(3, b"first", f.FLAG_FIN))
        assert await client.read_until_fin({1, 3}) == {3: b"you said: first"}
    finally:
        await client.close()


async def test_a_port_nobody_listens_on_gets_the_error_on_the_error_stream() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    client = Client(local)
    try:
        await client.pair(0, closed, 1)
        got = await client.read_until_fin({1, 3})
        assert got == {
            1: f"error forwarding port {closed} to pod web_default, uid uid-1: "
            f"dial tcp4 127.0.0.1:{closed}: connect: connection refused".encode()
        }
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({"streamtype": ["data"]}, '"port" header is required'),
        ({"streamtype": ["data"], "port": ["http"]}, 'unable to parse "http" as a port'),
        ({"streamtype": ["data"], "port": ["0"]}, 'port "0" must be > 0'),
        ({"streamtype": ["data"], "port": ["70000"]}, "value out of range"),
        ({"port": ["80"]}, '"streamType" header is required'),
        ({"streamtype": ["stdin"], "port": ["80"]}, 'invalid stream type "stdin"'),
    ],
)
async def test_a_stream_with_bad_headers_is_reset_for_the_kubelets_reason(
    headers: dict[str, list[str]], why: str
) -> None:
    client = Client(local)
    try:
        assert why in (portforward.refusal(Stream(client.session, 1, headers)) or "")
        await client.send(f.SynStream(1, headers))
        assert await client.next() == f.RstStream(1, f.CANCEL)
    finally:
        await client.close()


async def test_a_reset_data_stream_ends_the_forward_and_closes_the_error_stream() -> None:
    accepted = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await reader.read()  # says nothing, reads until the forward lets go
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    client = Client(local)
    try:
        await client.pair(0, server.sockets[0].getsockname()[1], 1)
        await accepted.wait()
        await client.send(f.RstStream(3, f.CANCEL))  # kubectl resets the data stream when its side is done
        assert await client.read_until_fin({1}) == {}
    finally:
        await client.close()
        server.close()


async def test_half_a_pair_times_out_with_the_kubelets_message() -> None:
    client = Client(local, creation_timeout=0.05)
    try:
        await client.send(f.SynStream(1, {"streamtype": ["error"], "port": ["80"], "requestid": ["4"]}))
        assert await client.next() == f.SynReply(1, {})
        frame = await client.next()
        assert isinstance(frame, f.DataFrame) and frame.data.endswith(b"request=4) timed out waiting for streams")
    finally:
        await client.close()


async def test_pings_are_echoed_and_streams_must_come_in_order() -> None:
    client = Client(local)
    try:
        await client.send(f.Ping(1), f.Ping(2), f.Ping(3))  # an even id would be this side's own ping
        assert [await client.next(), await client.next()] == [f.Ping(1), f.Ping(3)]
        await client.send(f.SynStream(5, {"streamtype": ["error"], "port": ["80"]}))
        assert await client.next() == f.SynReply(5, {})
        await client.send(f.SynStream(3, {"streamtype": ["error"], "port": ["80"]}))
        assert await client.next() == f.RstStream(3, f.PROTOCOL_ERROR)
        await client.send(f.SynStream(8, {"streamtype": ["error"], "port": ["80"]}))
        assert await client.next() == f.RstStream(8, f.PROTOCOL_ERROR)
    finally:
        await client.close()


async def test_a_broken_frame_ends_the_session_with_a_goaway() -> None:
    client = Client(local)
    try:
        assert await client.session.feed(bytes.fromhex("80020006 00000004 00000001")) is False  # SPDY/2
        assert await client.next() == f.GoAway(0, f.GOAWAY_PROTOCOL_ERROR)
    finally:
        await client.close()
