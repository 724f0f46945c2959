"""The NATS bus: typed publish/subscribe/request over catalog entries, JetStream streams and KV.

Every publish carries W3C trace context in headers and runs in a producer span; every handler
runs in a consumer span whose parent is the producer's. A message that fails to decode is
logged with its subject and sent to `dra.v1.deadletter.<identity>.<consumer>`; the consumer keeps going.
A message or KV value whose body names another identity than its subject or key (shared/identity.py)
is refused the same way, with reason `identity-mismatch`, and never reaches the handler.
A KV write carries trace context in its headers too; a reader keeps the context of the last value it
read of each key (`TypedKV.consume(key)`: a consumer span whose parent is the writer's).

Identity: a client that logs in as NATS user `u` takes replies on `_INBOX_<token(u)>.>` only and
files dead letters under `<token(u)>`, so the server's per-user permissions can pin both. KV reads
are direct gets of one key and watches through consumers whose filter is in the create subject,
which per-node permissions allow for that node's keys only.

The connection and credentials are `shared.natsconn`'s, JetStream retries and the gated context
`shared.jetstream`'s, typed KV buckets `shared.natskv`'s; this module binds them to the catalog.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter

from shared import identity, natsorigin
from shared.backoff import Backoff
from shared.events import cloudevents
from shared.events.base import Message, now_unix
from shared.events.catalog import (
    BUCKETS,
    DEAD_LETTER,
    STREAMS,
    Bucket,
    Entry,
    Stream,
    gate_prefix,
    stream_of,
)
from shared.events.deadletter import DeadLetter
from shared.jetstream import PUBLISH_RETRY_S, BusJetStream, ordered_consumer, publish_with_retry, retry_jetstream
from shared.logs import get_logger
from shared.natsconn import (
    BusError,
    LoginRefused,
    NatsTLS,
    consumer_token,
    dial,
    identity_token,
    inbox_prefix,
    node_identity,
)
from shared.natskv import CONSUMER_PENDING, TypedKV, decode_body, encode, note_pending
from shared.telemetry import ProducerSpan, extract_context, get_tracer, inject_headers

__all__ = [
    "PUBLISH_RETRY_S",
    "Bus",
    "BusError",
    "CONSUMER_PENDING",
    "LoginRefused",
    "MsgContext",
    "NatsTLS",
    "TypedKV",
    "encode",
    "identity_token",
    "inbox_prefix",
    "retry_jetstream",
]
log = get_logger(__name__)
DEAD_LETTERS = Counter(
    "gpu_dra_dead_letters", "Messages a consumer refused and filed as dead letters", ["consumer", "reason"]
)
tracer = get_tracer(__name__)
M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)


@dataclass
class MsgContext:
    """What a handler may want besides the decoded message."""

    subject: str
    headers: dict[str, str] = field(default_factory=dict)
    raw: Msg | None = None
    replayed: bool = False  # stored before the `since` consumer was made: the past, not news


Handler = Callable[[M, MsgContext], Awaitable[None]]
RequestHandler = Callable[[M], Awaitable[Message]]


class Bus:
    """A connected NATS client with JetStream, bound to the event catalog."""

    def __init__(self, nc: NatsClient, name: str, *, replicas: int = 1, user: str | None = None) -> None:
        self.nc = nc
        self.replicas = replicas
        self.name = name
        self.identity = identity_token(user) if user else consumer_token(name)
        self.user = user  # the NATS user it logged in as (None: no authentication, no identities to check)
        node_role = node_identity(user)
        self.js: JetStreamContext = BusJetStream(
            nc, gated=gate_prefix(node_role[1], node_role[0]) if node_role else None
        )
        self._subs: list[Subscription] = []
        self._kv_cache: dict[str, TypedKV[Any]] = {}
        self._kv_opening: dict[str, asyncio.Lock] = {}  # one opening per bucket: one TypedKV per bucket
        self._tasks: set[asyncio.Task[None]] = set()
        self._reconnect_callbacks: list[Callable[[], object]] = []

    def on_reconnect(self, callback: Callable[[], object]) -> None:
        """Call `callback()` after every reconnect. Core subscriptions come back by themselves but miss
        what was published while the connection was away; a consumer re-reads its state here."""
        self._reconnect_callbacks.append(callback)

    def notify_reconnected(self) -> None:
        """Call every `on_reconnect` callback (the connection's reconnect handler does, once per reconnect)."""
        for callback in list(self._reconnect_callbacks):
            try:
                callback()
            except Exception:  # noqa: BLE001 - one listener must not stop the others
                log.exception("reconnect callback failed", client=self.name)

    @classmethod
    async def connect(cls, url: str, *, name: str, replicas: int = 1, **options: Any) -> Bus:
        """Connect (`shared.natsconn.dial` with `options`: backoff, refused logins, TLS and creds; reconnect
        forever once in). `replicas`: the copies provision() asks for a new stream or bucket."""
        buses: list[Bus] = []

        def reconnected() -> None:
            for bus in buses:
                bus.notify_reconnected()

        nc, identity = await dial(url, name=name, reconnected=reconnected, **options)
        buses.append(cls(nc, name, replicas=replicas, user=identity))
        return buses[0]

    @property
    def provisions(self) -> bool:
        """Whether this client creates and updates streams and buckets: not a node's services, whose
        JetStream calls go through the state gate, which makes no such call for them."""
        return node_identity(self.user) is None

    async def provision(self) -> None:
        """Create the catalog's streams and KV buckets, or bring their limits up to the catalog's
        (idempotent; a node's services skip it: the deployment's init and cluster services provision).

        New streams and buckets get `self.replicas` copies; an existing stream keeps its replica
        count when it already has more (an operator may have scaled it up)."""
        if not self.provisions:
            return
        account = await retry_jetstream(self.js.account_info, "JetStream account info")
        most = int(account.limits.max_consumers or -1)  # the account's limit per stream, if it sets one

        def consumers(wanted: int) -> int:
            return min(wanted, most) if most > 0 else wanted

        for stream in STREAMS:
            await retry_jetstream(
                functools.partial(self._provision_stream, stream, consumers(stream.max_consumers)),
                f"provision stream {stream.name}",
            )
        for bucket in BUCKETS:
            await self._bucket(bucket)
            await retry_jetstream(
                functools.partial(self._limit_bucket, bucket, consumers(bucket.max_consumers)),
                f"limit bucket {bucket.name}",
            )

    async def _provision_stream(self, stream: Stream, max_consumers: int) -> None:
        replicas = self.replicas
        try:
            existing = await self.js.stream_info(stream.name)
            replicas = max(replicas, int(existing.config.num_replicas or 1))
        except nats.js.errors.NotFoundError:
            pass
        config = StreamConfig(
            name=stream.name,
            subjects=list(stream.subjects),
            max_age=stream.max_age_s,
            max_bytes=stream.max_bytes,
            max_msg_size=stream.max_msg_size,
            max_msgs_per_subject=stream.max_msgs_per_subject,
            discard=DiscardPolicy.NEW if stream.discard_new else DiscardPolicy.OLD,
            discard_new_per_subject=stream.discard_new and stream.max_msgs_per_subject > 0,
            allow_rollup_hdrs=False,
            storage=StorageType.FILE,
            duplicate_window=120.0,
            num_replicas=replicas,
            max_consumers=max_consumers,
        )
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await self.js.update_stream(config)

    async def _limit_bucket(self, bucket: Bucket, max_consumers: int) -> None:
        """The bucket's stream with the catalog's limits: no rollup header (a `Nats-Rollup: all` on one's
        own key would erase every key), value size and bucket size bounded, its watches as many as the fleet
        needs (nats-py creates a bucket with `max_consumers` -1, which nats-server 2.15 takes as 1,000)."""
        info = await self.js.stream_info(f"KV_{bucket.name}")
        config = info.config
        want = {
            "allow_rollup_hdrs": False,
            "max_msg_size": bucket.max_value_size,
            "max_bytes": bucket.max_bytes,
            "max_consumers": max_consumers,
        }
        if all(getattr(config, name) == value for name, value in want.items()):
            return
        for name, value in want.items():
            setattr(config, name, value)
        await self.js.update_stream(config)

    async def _bucket(self, bucket: Bucket) -> KeyValue:
        """The bucket, created if missing; retried while the cluster elects a leader. A node's services
        create nothing: they wait (PUBLISH_RETRY_S) for the provisioner (the publisher, the deployment's
        init) to have made it."""
        if self.provisions:
            return await retry_jetstream(lambda: self._bucket_once(bucket), f"open KV bucket {bucket.name}")
        loop = asyncio.get_running_loop()
        deadline, backoff = loop.time() + PUBLISH_RETRY_S, Backoff(initial_s=0.1, cap_s=2.0)
        while True:
            try:
                return await retry_jetstream(lambda: self.js.key_value(bucket.name), f"open KV bucket {bucket.name}")
            except nats.js.errors.BucketNotFoundError:
                if loop.time() > deadline:
                    raise BusError(
                        f"KV bucket {bucket.name} does not exist after {PUBLISH_RETRY_S:.0f}s: the "
                        "publisher (or the deployment's init, as admin) creates it; is it running?"
                    ) from None
                log.info("KV bucket not provisioned yet; waiting for the publisher", bucket=bucket.name)
                await asyncio.sleep(backoff.next())

    async def _bucket_once(self, bucket: Bucket) -> KeyValue:
        try:
            kv = await self.js.key_value(bucket.name)
            if not (await kv.status()).stream_info.config.allow_direct:
                await self._enable_direct_get(bucket)
                kv = await self.js.key_value(bucket.name)  # its reads by direct get from now on
            return kv
        except nats.js.errors.BucketNotFoundError:
            try:
                return await self.js.create_key_value(
                    KeyValueConfig(
                        bucket=bucket.name,
                        history=bucket.history,
                        ttl=bucket.ttl_s or None,
                        replicas=self.replicas,
                        direct=True,  # TypedKV reads by direct get only
                        max_value_size=bucket.max_value_size,
                        max_bytes=bucket.max_bytes,
                    )
                )
            except nats.js.errors.BadRequestError:
                return await self.js.key_value(bucket.name)

    async def _enable_direct_get(self, bucket: Bucket) -> None:
        """A bucket made before reads went through direct get: turn it on (the publisher and admin may;
        a node user's attempt is refused and logged, and its reads fail until one of them has)."""
        stream = f"KV_{bucket.name}"
        try:
            info = await self.js.stream_info(stream)
            info.config.allow_direct = True
            await asyncio.wait_for(self.js.update_stream(info.config), timeout=2.0)
            log.info("direct get enabled on KV bucket", bucket=bucket.name)
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning(
                "KV bucket has no direct get and this user cannot enable it; reads fail until the "
                "publisher starts (or run `nats stream edit --allow-direct`)",
                bucket=bucket.name,
                stream=stream,
                error=str(exc) or type(exc).__name__,
            )

    async def kv(self, bucket: Bucket) -> TypedKV[Any]:
        """The typed KV bucket (created if missing): the same object for every caller, those that asked
        while it was being opened included (it keeps the trace context of what it reads, which a
        watch on one object and a consumer span on another would not share)."""
        cached = self._kv_cache.get(bucket.name)
        if cached is None:
            async with self._kv_opening.setdefault(bucket.name, asyncio.Lock()):
                cached = self._kv_cache.get(bucket.name)
                if cached is None:
                    await self._bucket(bucket)  # created if missing, direct get turned on if it can be
                    cached = TypedKV(self, bucket)
                    self._kv_cache[bucket.name] = cached
        return cached

    @contextlib.contextmanager
    def _outgoing(
        self,
        entry: Entry,
        message: Message,
        msg_id: str | None,
        durable: bool,
        tokens: dict[str, str],
        traceparent: str | None = None,
    ) -> Iterator[tuple[str, bytes, dict[str, str]]]:
        """An event's subject, body and headers, inside its producer span (`telemetry.ProducerSpan`, its parent
        the current span or the one a stored `traceparent` names), which ends with the block."""
        if not isinstance(message, entry.message):
            raise TypeError(f"{entry.name} carries {entry.message.__name__}, not {type(message).__name__}")
        subject = entry.format(**tokens)
        # every durable publish carries a message id, so a retry is de-duplicated by the stream; the
        # id (given or drawn) is also the CloudEvents id of an event that has no event id of its own
        event_id = msg_id or uuid.uuid4().hex
        headers = cloudevents.headers(entry, message, subject, event_id, self.name)
        if msg_id or durable:
            headers["Nats-Msg-Id"] = event_id
        with ProducerSpan(f"publish {entry.name}", subject, headers, traceparent) as carried:
            yield subject, encode(message), carried

    async def publish(
        self, entry: Entry, message: Message, *, msg_id: str | None = None, durable: bool | None = None, **tokens: str
    ) -> None:
        """Publish an event. Durable events (by default the entry's `durable`) go through JetStream (stored,
        de-duplicated by msg_id); the others are core NATS publishes, seen only by who listens now."""
        durable = entry.durable if durable is None else durable
        with self._outgoing(entry, message, msg_id, durable, tokens) as (subject, payload, headers):
            if durable:
                await publish_with_retry(self.js, subject, payload, headers)
            else:
                await self.nc.publish(subject, payload, headers=headers)

    async def publish_nowait(
        self,
        entry: Entry,
        message: Message,
        *,
        msg_id: str,
        traceparent: str | None = None,
        **tokens: str,
    ) -> asyncio.Future[Any]:
        """Send a durable event to JetStream without waiting for its store: the future of its ack (a
        JetStream error or NoStreamResponseError as its exception; await it with a timeout). For a sender
        that has many in flight at once; the publish span (the child of the current span, or of the one a
        stored `traceparent` names) ends when the message is sent."""
        with self._outgoing(entry, message, msg_id, True, tokens, traceparent) as (subject, payload, headers):
            publish: Any = self.js.publish_async
            future: asyncio.Future[Any] = await publish(subject, payload, headers=headers)
        return future

    async def _dead_letter(self, msg: Msg, consumer: str, error: str, reason: str = "undecodable") -> None:
        if reason == "undecodable":
            log.error("undecodable message dead-lettered", subject=msg.subject, consumer=consumer, error=error)
        await self.dead_letter(msg.subject, msg.data, consumer, error, reason=reason)

    async def refuse(self, mismatch: identity.Mismatch, data: bytes, consumer: str) -> None:
        """A message or value that speaks for another identity: counted, logged, dead-lettered."""
        identity.refused(consumer, mismatch)
        await self.dead_letter(mismatch.where, data, consumer, mismatch.error, reason=identity.REASON)

    async def dead_letter(self, subject: str, data: bytes, consumer: str, error: str, *, reason: str) -> None:
        """Keep a refused message on `dra.v1.deadletter.<identity>.<consumer>` (never raises: a lost dead letter
        must not stop the consumer)."""
        DEAD_LETTERS.labels(consumer, reason).inc()
        letter = DeadLetter(
            subject=subject,
            consumer=consumer,
            error=error,
            payload=data[:65536].decode("utf-8", "replace"),
            observed_at=now_unix(),
            reason=reason,
        )
        try:
            await self.publish(DEAD_LETTER, letter, identity=self.identity, consumer=consumer_token(consumer))
        except Exception as exc:  # noqa: BLE001 - a lost dead letter must not stop the consumer
            log.error("dead letter not stored", subject=subject, error=str(exc))

    async def _refused_relay(self, msg: Msg, consumer: str) -> bool:
        """True (and dead-lettered, counted, logged) when the server sent `msg` on a core subscription on
        someone's behalf (a consumer delivery or a JetStream answer to a chosen reply subject)."""
        why = natsorigin.relayed(msg.reply, msg.headers)
        if not why:
            return False
        log.warning("message relayed by the server refused", subject=msg.subject, consumer=consumer, why=why)
        await self.dead_letter(msg.subject, msg.data, consumer, why, reason=natsorigin.RELAYED)
        return True

    async def _refused_asker(self, entry: Entry, msg: Msg, served: dict[str, str]) -> bool:
        """True (and dead-lettered, counted, logged) when a request's reply is not the inbox of one of the
        entry's requesters on its node. Only with authenticated identities: without them every inbox is
        `_INBOX` and no one is anyone."""
        tokens = {**served, **(entry.parse(msg.subject) or {})}  # the served node, or the subject's
        why = natsorigin.foreign_requester(entry, tokens, msg.reply, inbox_prefix) if self.user else ""
        if not why:
            return False
        log.warning("request from someone not allowed to ask refused", subject=msg.subject, why=why)
        await self.dead_letter(msg.subject, msg.data, self.name, why, reason=natsorigin.NOT_REQUESTER)
        return True

    def _decode(self, decoder: msgspec.json.Decoder[Any], msg: Msg) -> tuple[Any, str]:
        return decode_body(decoder, msg.data)

    async def subscribe(
        self,
        entry: Entry,
        handler: Handler[Any],
        *,
        queue: str | None = None,
        durable: str | None = None,
        deliver_new: bool = False,
        since: float | None = None,
        **tokens: str,
    ) -> Subscription:
        """Call `handler(message, ctx)` for each message on the entry's subjects.

        `durable`: a JetStream durable consumer of that name (replays what it has not acked,
        survives restarts); `since` (a unix time): one ordered consumer of the entry's stream from then on
        (shared.jetstream.ordered_consumer), what the stream held when it was made first (`ctx.replayed`), then
        every new message, each once and in order; neither: a core NATS subscription (live messages only).
        """
        decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(entry.message)
        subject = entry.wildcard(**tokens)
        consumer = durable or self.name

        async def on_message(msg: Msg, replayed: bool = False) -> None:
            headers = dict(msg.headers or {})
            if durable or since is not None:
                note_pending(consumer, msg)
            elif await self._refused_relay(msg, consumer):
                return
            message, error = self._decode(decoder, msg)
            if error:
                await self._dead_letter(msg, consumer, error)
                if durable:
                    await msg.ack()
                return
            mismatch = identity.check_event(entry, msg.subject, message)
            if mismatch is not None:
                await self.refuse(mismatch, msg.data, consumer)
                if durable:
                    await msg.ack()
                return
            parent = extract_context(headers)
            with tracer.start_as_current_span(f"consume {entry.name}", context=parent, kind=SpanKind.CONSUMER) as span:
                span.set_attribute("messaging.system", "nats")
                span.set_attribute("messaging.destination.name", msg.subject)
                try:
                    ctx = MsgContext(subject=msg.subject, headers=headers, raw=msg, replayed=replayed)
                    await handler(message, ctx)
                except Exception as exc:  # noqa: BLE001 - one bad message must not end the consumer
                    span.record_exception(exc)
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    log.exception("handler failed", subject=msg.subject, consumer=consumer)
                    if durable:
                        await msg.nak(delay=1.0)
                    return
            if durable:
                await msg.ack()

        if durable:
            config = ConsumerConfig(
                durable_name=consumer_token(durable),
                deliver_policy=DeliverPolicy.NEW if deliver_new else DeliverPolicy.ALL,
                ack_wait=30.0,
                max_deliver=20,
                filter_subject=subject,
            )
            sub: Subscription = await self.js.subscribe(
                subject, queue=queue, cb=on_message, durable=consumer_token(durable), manual_ack=True, config=config
            )
        elif since is not None:
            stream = stream_of(entry.subject)
            if stream is None or queue:
                raise ValueError(f"{entry.name}: no stream keeps it, or a queue group was asked of a replay")
            sub, _ = await ordered_consumer(self.nc, self.js, stream.name, subject, on_message, since=since)
        else:
            sub = await self.nc.subscribe(subject, queue=queue or "", cb=on_message)
        self._subs.append(sub)
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        """End a subscription that subscribe() made, before the bus closes (a lost connection: already ended)."""
        with contextlib.suppress(ValueError):
            self._subs.remove(sub)
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()

    async def serve(
        self, entry: Entry, handler: RequestHandler[Any], *, queue: str | None = None, **tokens: str
    ) -> Subscription:
        """Answer requests on the entry's subject with `await handler(request) -> reply`."""
        if entry.reply is None:
            raise TypeError(f"{entry.name} is not a request/reply entry")
        decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(entry.message)
        reply_type = entry.reply
        subject = entry.wildcard(**tokens)

        async def on_request(msg: Msg) -> None:
            headers = dict(msg.headers or {})
            if await self._refused_relay(msg, self.name) or await self._refused_asker(entry, msg, tokens):
                return  # never answered: a reply would go where the asker chose
            request, error = self._decode(decoder, msg)
            if error:
                await self._dead_letter(msg, self.name, error)
                if msg.reply:
                    await msg.respond(_error_reply(reply_type, "invalid-request", f"undecodable request: {error}"))
                return
            with tracer.start_as_current_span(
                f"serve {entry.name}", context=extract_context(headers), kind=SpanKind.SERVER
            ) as span:
                try:
                    reply = await handler(request)
                except Exception as exc:  # noqa: BLE001 - a failed handler answers with an error
                    span.record_exception(exc)
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    log.exception("request handler failed", subject=msg.subject)
                    if msg.reply:
                        await msg.respond(_error_reply(reply_type, "internal", f"{type(exc).__name__}: {exc}"))
                    return
                if msg.reply:
                    await self.nc.publish(msg.reply, encode(reply), headers=inject_headers())

        sub = await self.nc.subscribe(subject, queue=queue or "", cb=on_request)
        self._subs.append(sub)
        return sub

    async def request(self, entry: Entry, message: Message, *, timeout: float = 5.0, **tokens: str) -> Any:
        """Send a request and decode the typed reply; BusError when nobody answers in time."""
        if entry.reply is None:
            raise TypeError(f"{entry.name} is not a request/reply entry")
        subject = entry.format(**tokens)
        with tracer.start_as_current_span(f"request {entry.name}", kind=SpanKind.CLIENT) as span:
            span.set_attribute("messaging.destination.name", subject)
            try:
                msg = await self.nc.request(subject, encode(message), timeout=timeout, headers=inject_headers())
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
                span.set_status(Status(StatusCode.ERROR, "no reply"))
                raise BusError(
                    f"no reply on {subject} within {timeout}s ({type(exc).__name__}): "
                    "is the service for this node running?"
                ) from exc
            reply, error = decode_body(msgspec.json.Decoder(entry.reply), msg.data)
            if error:
                raise BusError(f"malformed reply on {subject}: {error}")
            return reply

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        """Run a background task tied to this bus's lifetime."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001, S110 - closing anyway
                pass
        self._subs.clear()
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=2.0)
            except Exception:  # noqa: BLE001 - close regardless
                await self.nc.close()


def _error_reply(reply_type: type[Message], code: str, message: str) -> bytes:
    """An error reply of the entry's reply type, when that type has `ok` and `error` fields."""
    from shared.events.devices import DeviceOpError

    fields = set(reply_type.__struct_fields__)
    if {"ok", "error"} <= fields:
        return encode(reply_type(ok=False, error=DeviceOpError(code=code, message=message)))
    return b""
