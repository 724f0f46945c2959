"""JetStream KV buckets of one message type (`TypedKV`): reads by direct get, writes and reads carrying the
writer's trace context, values whose body names another identity than their key refused; and the bus's body
codec (`encode`, `decode_body`).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import Gauge

from shared import identity, natsorigin
from shared.events.base import Message
from shared.events.catalog import (
    Bucket,
)
from shared.jetstream import publish_with_retry, retry_jetstream
from shared.kvwatch import KvWatch
from shared.logs import get_logger
from shared.natsconn import BusError
from shared.telemetry import get_tracer, inject_headers, traceparent_context


class KVHost(Protocol):
    """What a typed bucket needs of the bus that opened it (shared.bus.Bus)."""

    name: str
    nc: NatsClient
    js: JetStreamContext

    def spawn(self, coro: Awaitable[None]) -> Any: ...
    async def refuse(self, mismatch: identity.Mismatch, data: bytes, consumer: str) -> None: ...
    async def dead_letter(self, subject: str, data: bytes, consumer: str, error: str, *, reason: str) -> None: ...


log = get_logger(__name__)
CONSUMER_PENDING = Gauge(
    "gpu_dra_nats_consumer_pending",
    "Messages a JetStream consumer has yet to deliver (its num_pending, as of its last "
    "delivery): a KV watch (consumer kv:<bucket>) or a durable consumer (its name)",
    ["consumer"],
)
tracer = get_tracer(__name__)
M = TypeVar("M", bound=Message)
_ENCODER = msgspec.json.Encoder()
# How long a key listing waits for its watch's next key or the end of the values before it fails (its caller
# retries): a listing whose last value the stream lost before sending it would otherwise wait for the next write.
KEYS_WAIT_S = 5.0


def note_pending(consumer: str, msg: Msg) -> None:
    """CONSUMER_PENDING from a delivered JetStream message's metadata (what the consumer's info would
    say, without a request: no extra permission, no polling)."""
    with contextlib.suppress(nats.errors.NotJSMessageError):  # not a JetStream delivery: nothing to read
        CONSUMER_PENDING.labels(consumer).set(msg.metadata.num_pending)


def encode(message: Message) -> bytes:
    return _ENCODER.encode(message)


def decode_body(decoder: msgspec.json.Decoder[Any], data: bytes) -> tuple[Any, str]:
    """A message body decoded, or None and why not: malformed, the wrong shape, or nested deeper
    than the decoder can follow (msgspec raises RecursionError there; it must become a dead letter,
    never an exception out of a consumer)."""
    try:
        return decoder.decode(data), ""
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return None, str(exc)
    except RecursionError:
        return None, "JSON nested too deeply to decode: send a flat message of the catalog's schema"


class _KeepingContext:
    """The bus's JetStream context as one bucket's KeyValue uses it, keeping the `traceparent` of every
    value it reads by key: nats-py's KV entries drop the headers. A get's is kept at once; a watch's
    (`arrived`) is held per (key, revision) until its entry is read (`read`), so a second write of a key that arrives
    before the first is acted on does not lend the first its trace."""

    MAX_KEYS = 100_000  # bounded: one short string a key; cleared if a bucket ever holds more

    def __init__(self, js: JetStreamContext, prefix: str) -> None:
        self._js = js
        self._prefix = prefix
        self._consumer = f"kv:{prefix.split('.')[1]}"  # bounded: one per bucket
        self.traceparents: dict[str, str] = {}  # key: the traceparent of the value last read ("" none)
        self._arrived: dict[tuple[str, int], str] = {}  # (key, revision) delivered, not read yet: its traceparent
        self.relayed: dict[tuple[str, int], str] = {}  # (key, revision) delivered with a relay's marks: why

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    def _key(self, subject: str | None) -> str | None:
        return subject[len(self._prefix) :] if subject and subject.startswith(self._prefix) else None

    def _keep(self, key: str, traceparent: str) -> None:
        if not traceparent:
            self.traceparents.pop(key, None)  # a write from outside the bus
            return
        if len(self.traceparents) >= self.MAX_KEYS:
            self.traceparents.clear()
        self.traceparents[key] = traceparent

    def _arrive(self, key: str, revision: int, headers: dict[str, str]) -> None:
        """A watch delivered this revision: hold its writer's context, and why a relay stored it, if one did
        (the stored headers, as delivered). Bounded: a watch stopped before reading its entries leaves them."""
        if len(self._arrived) >= self.MAX_KEYS:
            self._arrived.clear()
        self._arrived[(key, revision)] = headers.get("traceparent", "")
        why = natsorigin.relayed(None, headers)
        if why:
            if len(self.relayed) >= self.MAX_KEYS:
                self.relayed.clear()
            self.relayed[(key, revision)] = why

    def read(self, key: str, revision: int) -> None:
        """A watch's entry is being acted on: its writer's context is now the key's (none if unknown)."""
        self._keep(key, self._arrived.pop((key, revision), ""))

    async def publish(
        self, subject: str, payload: bytes = b"", *args: Any, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> Any:
        """nats-py's own KV writes (delete, purge): with the caller's trace context, like TypedKV.put."""
        publish: Any = self._js.publish
        return await publish(subject, payload, *args, headers=inject_headers(headers) or headers, **kwargs)

    async def get_msg(self, *args: Any, **kwargs: Any) -> Any:
        msg = await self._js.get_msg(*args, **kwargs)
        key = self._key(msg.subject)
        if key is not None:
            self._keep(key, (msg.headers or {}).get("traceparent", ""))
        return msg

    def arrived(self, msg: Msg) -> None:
        """A watch's delivery (shared.kvwatch): its writer's context held until its entry is read."""
        key = self._key(msg.subject)
        if key is None:
            return
        with contextlib.suppress(nats.errors.NotJSMessageError):
            self._arrive(key, msg.metadata.sequence.stream, msg.headers or {})
        note_pending(self._consumer, msg)


class TypedKV(Generic[M]):
    """A JetStream KV bucket whose values are one message type."""

    def __init__(self, bus: KVHost, bucket: Bucket) -> None:
        self._bus = bus
        self.bucket = bucket
        # Reads go through direct get of the one key ($JS.API.DIRECT.GET.<stream>.<key subject>),
        # the read a per-node permission can name; STREAM.MSG.GET is not allowed to node users.
        stream = f"KV_{bucket.name}"
        self._js = _KeepingContext(bus.js, f"$KV.{bucket.name}.")
        self._kv = KeyValue(
            name=bucket.name,
            stream=stream,
            pre=f"$KV.{bucket.name}.",
            js=self._js,  # type: ignore[arg-type]
            direct=True,
        )
        self._decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(bucket.message)
        self._refused: set[tuple[str, int]] = set()  # (key, revision or value hash) already dead-lettered

    def decode(self, key: str, raw: bytes | None, revision: int = 0) -> M | None:
        """The value stored under `key`, or None when it is empty, undecodable or names another
        identity than its key (refused: counted, logged and dead-lettered once per revision)."""
        if raw is None or raw == b"":
            return None
        decoded, error = decode_body(self._decoder, raw)
        value: M = decoded
        if error:
            log.error("undecodable KV value skipped", bucket=self.bucket.name, key=key, error=error)
            return None
        mismatch = identity.check_kv(self.bucket, key, value)
        if mismatch is None:
            return value
        seen = (key, revision or hash(raw))
        if seen not in self._refused:  # a resync reads it again: report each revision once
            if len(self._refused) >= 4096:  # bounded: a node rewriting its key must not grow this without end
                self._refused.clear()
            self._refused.add(seen)
            self._bus.spawn(self._bus.refuse(mismatch, raw, self._bus.name))
        return None

    async def open_watch(self, pattern: str = ">", *, listing: bool = False) -> KvWatch:
        """A watch of this bucket's keys that match `pattern` (shared.kvwatch): read it through `updates`, end it
        with its `stop`. `listing`: keys only, deletes skipped, no writer context held (a one-off listing)."""
        return await KvWatch.start(
            self._bus.nc,
            self._bus.js,
            self.bucket.name,
            pattern,
            meta_only=listing,
            ignore_deletes=listing,
            arrived=None if listing else self._js.arrived,
        )

    async def updates(self, watch: KvWatch) -> AsyncIterator[KeyValue.Entry | None]:
        """A watch's entries (None: the end of the replay), each entry's writer context kept for consume() as
        it is handed on."""
        async for entry in watch:
            if entry is not None:
                self._js.read(entry.key, int(entry.revision or 0))
            yield entry

    @property
    def raw(self) -> KeyValue:
        """The bucket as nats-py's KeyValue (untyped), reading through this TypedKV (contexts kept)."""
        return self._kv

    @contextlib.contextmanager
    def consume(self, key: str) -> Iterator[trace.Span]:
        """A consumer span for acting on the value last read of `key`: the child of the span that wrote
        it (its `traceparent`, kept from the read), a root when the writer sent none."""
        parent = traceparent_context(self._js.traceparents.get(key, ""))
        with tracer.start_as_current_span(
            f"consume {self.bucket.name}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes={"messaging.system": "nats", "messaging.destination.name": f"$KV.{self.bucket.name}.{key}"},
        ) as span:
            yield span

    async def get(self, key: str) -> M | None:
        try:
            entry = await retry_jetstream(lambda: self._kv.get(key), f"KV get {self.bucket.name}/{key}")
        except nats.js.errors.KeyNotFoundError:
            return None
        return self.decode(key, entry.value, int(entry.revision or 0))

    async def put(self, key: str, value: Message) -> int:
        """Write a value; the write carries trace context like any publish."""
        headers = inject_headers({"Nats-Msg-Id": uuid.uuid4().hex})  # a retry is dropped as a duplicate
        ack = await publish_with_retry(self._bus.js, f"$KV.{self.bucket.name}.{key}", encode(value), headers)
        return int(ack.seq)

    async def delete(self, key: str) -> None:
        try:
            await self._kv.delete(key)
        except nats.js.errors.KeyNotFoundError:
            return

    async def keys(self, pattern: str = ">") -> list[str]:
        """Keys matching `pattern` (a node user may list only its own node's keys), as the bucket held them."""
        watch = await self.open_watch(pattern, listing=True)
        keys: list[str] = []
        try:
            while True:
                try:
                    async with asyncio.timeout(KEYS_WAIT_S):
                        entry = await watch.next()
                except TimeoutError:
                    raise BusError(
                        f"KV keys of {self.bucket.name}: the listing did not end within {KEYS_WAIT_S:.0f}s"
                    ) from None
                if entry is None:  # the end of the values
                    break
                keys.append(entry.key)
        finally:
            await watch.stop()
        return keys

    async def items(self, pattern: str = ">") -> dict[str, M]:
        out: dict[str, M] = {}
        for key in await self.keys(pattern):
            value = await self.get(key)
            if value is not None:
                out[key] = value
        return out

    async def watch(
        self,
        keys: str = ">",
        *,
        refused_as_none: bool = False,
    ) -> AsyncGenerator[tuple[str, M | None], None]:
        """Current values, then every change: (key, value) with value None for a delete.

        An empty marker (key "") separates the initial values from live updates. A value that does not
        decode, names another identity, or was stored by the server relaying someone's answer onto the
        key (shared.natsorigin) is refused and skipped: it never replaces the last good value. The key's
        owner, which restores what it wrote, asks to see it as None (`refused_as_none`)."""
        watch = await self.open_watch(keys)
        try:
            async for entry in self.updates(watch):
                if entry is None:
                    yield "", None
                    continue
                if entry.operation in ("DEL", "PURGE"):
                    yield entry.key, None
                    continue
                value = self.accepted(entry.key, entry.value, int(entry.revision or 0))
                if value is not None or refused_as_none:
                    yield entry.key, value
        finally:
            await watch.stop()

    def accepted(self, key: str, raw: bytes | None, revision: int) -> M | None:
        """A watched value, or None when it is refused (relayed here by the server, undecodable, or
        another identity's): the caller keeps the last good value."""
        why = self._js.relayed.pop((key, revision), "")
        if why:
            where = f"$KV.{self.bucket.name}.{key}"
            log.warning("KV value stored by a server relay refused", key=where, why=why)
            self._bus.spawn(
                self._bus.dead_letter(where, raw or b"", self._bus.name, f"stored by {why}", reason=natsorigin.RELAYED)
            )
            return None
        return self.decode(key, raw, revision)
