"""KV watches and key listings over a real nats-server: the end-of-replay marker follows exactly the values the
bucket held, even when the server's deliveries reach the client after its answers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from shared import natskv
from shared.bus import Bus
from shared.events import catalog
from shared.natsconn import BusError
from shared.natsserver import EmbeddedNats
from tests.shared.test_bus import inventory


class HoldingRelay:
    """A TCP relay between one NATS client and the server that can hold back what JetStream consumers push to
    the client while request answers and everything else go through: the order a loaded server or network can
    give, made certain."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._holding = False
        self._held: list[bytes] = []
        self._changed = asyncio.Condition()
        self._to_client: asyncio.StreamWriter | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def hold(self) -> None:
        self._holding = True

    async def held(self, count: int) -> None:
        """Wait until `count` deliveries are held."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self._held) >= count), 10)

    def release(self) -> None:
        """Pass on what was held, in order, and hold nothing more."""
        assert self._to_client is not None
        self._holding = False
        for frame in self._held:
            self._to_client.write(frame)
        self._held.clear()

    @staticmethod
    def _pushed(parts: list[bytes]) -> bool:
        """A consumer's push: a message (its reply an ack subject), a flow control request, or an idle heartbeat
        (sent to the deliver subject itself, `_INBOX.<id>`)."""
        reply = parts[3] if len(parts) >= (6 if parts[0].upper() == b"HMSG" else 5) else b""
        return reply.startswith((b"$JS.ACK.", b"$JS.FC.")) or parts[1].count(b".") == 1

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self._port)
        self._to_client = client_w
        for task in (self._up(client_r, server_w), self._down(server_r, client_w)):
            self._tasks.add(asyncio.create_task(task))

    @staticmethod
    async def _up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while line := await reader.readline():
                parts = line.split()
                op = parts[0].upper() if parts else b""
                body = await reader.readexactly(int(parts[-1]) + 2) if op in (b"MSG", b"HMSG") else b""
                if self._holding and op in (b"MSG", b"HMSG") and self._pushed(parts):
                    async with self._changed:
                        self._held.append(line + body)
                        self._changed.notify_all()
                    continue
                writer.write(line + body)
                await writer.drain()
        writer.close()


@pytest.fixture
async def relayed(nats_server: EmbeddedNats) -> AsyncIterator[tuple[Bus, HoldingRelay]]:
    relay = HoldingRelay(int(nats_server.url.rsplit(":", 1)[1]))
    bus = await Bus.connect(await relay.start(), name="watcher")
    await bus.provision()
    try:
        yield bus, relay
    finally:
        relay.release()
        await bus.close()
        await relay.close()


async def test_a_listing_waits_for_values_delivered_after_the_answers(relayed: tuple[Bus, HoldingRelay]) -> None:
    bus, relay = relayed
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    for node in ("n1", "n2"):
        await kv.put(node, inventory(node))
    await kv.delete("n2")  # a deleted key's marker is part of the replay, not listed
    await kv.put("n3", inventory("n3"))
    relay.hold()
    listing = asyncio.create_task(kv.keys())
    await relay.held(3)  # every answer went through; the three deliveries did not
    assert not listing.done()
    relay.release()
    assert await asyncio.wait_for(listing, 10) == ["n1", "n3"]


async def test_a_watch_marks_the_replay_after_its_values_then_hands_on_changes(
    relayed: tuple[Bus, HoldingRelay],
) -> None:
    bus, relay = relayed
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    for node in ("n1", "n2"):
        await kv.put(node, inventory(node))
    relay.hold()
    watch = kv.watch()
    first = asyncio.create_task(anext(watch))
    await relay.held(2)
    assert not first.done()
    relay.release()
    seen = [(await first)[0]] + [(await asyncio.wait_for(anext(watch), 10))[0] for _ in range(2)]
    assert seen == ["n1", "n2", ""]
    await kv.put("n3", inventory("n3"))
    await kv.delete("n1")
    assert [await asyncio.wait_for(anext(watch), 10) for _ in range(2)] == [("n3", inventory("n3")), ("n1", None)]
    await watch.aclose()


async def test_an_empty_bucket_marks_the_replay_at_once_and_stop_ends_a_watch(bus: Bus) -> None:
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    assert await kv.keys() == []
    watch = await kv.open_watch()
    assert await asyncio.wait_for(watch.next(), 10) is None
    await kv.put("n1", inventory("n1"))
    entry = await asyncio.wait_for(watch.next(), 10)
    assert entry is not None and (entry.key, entry.operation) == ("n1", None)
    await watch.stop()
    with pytest.raises(StopAsyncIteration):
        await watch.next()
    with pytest.raises(StopAsyncIteration):
        await watch.next()  # and stays ended


async def test_a_listing_whose_values_never_come_fails_in_bounded_time_and_a_retry_lists(
    relayed: tuple[Bus, HoldingRelay], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing whose replay does not arrive (held here; a stream that lost a value before sending it) must not
    stall its caller (the preparer's health re-read, discovery's start): it fails after KEYS_WAIT_S without a
    key, and its caller's retry lists."""
    bus, relay = relayed
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    await kv.put("n1", inventory("n1"))
    monkeypatch.setattr(natskv, "KEYS_WAIT_S", 0.2)
    relay.hold()
    with pytest.raises(BusError, match="did not end within"):
        await asyncio.wait_for(kv.keys(), 5)
    relay.release()
    assert await asyncio.wait_for(kv.keys(), 5) == ["n1"]


async def test_a_watch_stops_once_its_connection_is_closed(nats_server: EmbeddedNats) -> None:
    """A watch ended by its task's cancellation after the bus closed (a service shutting down) ends quietly: an
    error from its stop would replace the cancellation, and a caller that watches again after errors would never
    end."""
    bus = await Bus.connect(nats_server.url, name="closing")
    await bus.provision()
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    watch = kv.watch()
    assert await asyncio.wait_for(anext(watch), 10) == ("", None)
    await bus.close()
    await watch.aclose()
