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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import ssl
import urllib.parse
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

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
    ConsumerInfo,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from nats.js.manager import JetStreamManager
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Gauge

from shared import identity, natsorigin
from shared.backoff import Backoff
from shared.events import cloudevents
from shared.events.base import Message, now_unix
from shared.events.catalog import (
    BUCKETS,
    DEAD_LETTER,
    NODE_ROLES,
    STREAMS,
    Bucket,
    Entry,
    Stream,
    gate_prefix,
)
from shared.events.deadletter import DeadLetter
from shared.logs import Sparse, get_logger
from shared.natsjwt import Creds, CredsError
from shared.tasks import raise_if_cancelling
from shared.telemetry import extract_context, get_tracer, inject_headers, traceparent_context

log = get_logger(__name__)
NATS_CONNECTED = Gauge("gpu_dra_nats_connected", "1 while the client's NATS connection is up", ["client"])
NATS_RECONNECTS = Counter("gpu_dra_nats_reconnects", "NATS reconnections after a lost connection", ["client"])
JETSTREAM_RETRIES = Counter("gpu_dra_jetstream_retries", "JetStream calls retried (leader changes, reconnects)")
DEAD_LETTERS = Counter("gpu_dra_dead_letters", "Messages a consumer refused and filed as dead letters",
                       ["consumer", "reason"])
JETSTREAM_REFUSED = Counter("gpu_dra_jetstream_refused",
                            "Writes the JetStream server refused for a limit (message size, messages per "
                            "subject, bucket or stream full, rollup): this identity's share is used up",
                            ["subject_kind", "reason"])
CONSUMER_PENDING = Gauge("gpu_dra_nats_consumer_pending",
                         "Messages a JetStream consumer has yet to deliver (its num_pending, as of its last "
                         "delivery): a KV watch (consumer kv:<bucket>) or a durable consumer (its name)",
                         ["consumer"])
tracer = get_tracer(__name__)


def _note_pending(consumer: str, msg: Msg) -> None:
    """CONSUMER_PENDING from a delivered JetStream message's metadata (what the consumer's info would
    say, without a request: no extra permission, no polling)."""
    with contextlib.suppress(nats.errors.NotJSMessageError):  # not a JetStream delivery: nothing to read
        CONSUMER_PENDING.labels(consumer).set(msg.metadata.num_pending)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)
T = TypeVar("T")

_ENCODER = msgspec.json.Encoder()
_CONSUMER_NAME = re.compile(r"[^A-Za-z0-9_-]")


class BusError(RuntimeError):
    """The bus could not do what was asked (not connected, no reply, bad reply)."""


class LoginRefused(BusError):
    """NATS refused the client's credentials (Bus.connect gave up; retrying will not help until they change)."""


PUBLISH_RETRY_S = 30.0
"""How long a JetStream publish keeps retrying through a leader change before it gives up."""


def _retryable(exc: BaseException) -> bool:
    """A JetStream error that a leader change or reconnect explains (worth retrying)."""
    if isinstance(exc, (nats.errors.TimeoutError, nats.errors.NoRespondersError, TimeoutError,
                        nats.errors.ConnectionReconnectingError, nats.js.errors.ServiceUnavailableError,
                        nats.js.errors.NoStreamResponseError)):
        return True
    if isinstance(exc, nats.js.errors.APIError):
        # KV errors (KeyNotFoundError, ...) subclass APIError without setting its fields
        code = getattr(exc, "code", None)
        text = f"{getattr(exc, 'description', '') or ''} {getattr(exc, 'err_code', '') or ''} {code or ''}"
        return "leader" in text.lower() or code == 503
    return False


async def retry_jetstream(
    call: Callable[[], Awaitable[T]], what: str, *, budget_s: float = PUBLISH_RETRY_S
) -> T:
    """`await call()`, retrying a leader change / reconnect with backoff for `budget_s`.

    For JetStream API calls (stream and bucket lookups, KV reads and watches) that fail while a
    NATS cluster elects a new meta or stream leader; any other error is raised at once.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    backoff = Backoff(initial_s=0.05, cap_s=1.0)
    delay = backoff.next()
    attempts = 0
    while True:
        attempts += 1
        try:
            return await call()
        except Exception as exc:  # noqa: BLE001 - classified just below
            if not _retryable(exc):
                raise
            if loop.time() + delay > deadline:
                raise BusError(
                    f"{what} failed {attempts} times over {budget_s:.0f}s "
                    f"({type(exc).__name__}: {exc}); check that a majority of the NATS cluster is up"
                ) from exc
            log.warning("jetstream call retried", call=what, attempt=attempts, error=type(exc).__name__)
            JETSTREAM_RETRIES.inc()
            await asyncio.sleep(delay)
            delay = backoff.next()


async def publish_with_retry(
    js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str], *, budget_s: float = PUBLISH_RETRY_S
) -> Any:
    """Publish to JetStream, retrying a leader change / reconnect with backoff for `budget_s`.

    `headers` must carry a Nats-Msg-Id: the stream drops a retry whose first try was already
    stored, so a retry never doubles an event.
    """
    try:
        return await retry_jetstream(lambda: js.publish(subject, payload, headers=headers),
                                     f"JetStream publish to {subject}", budget_s=budget_s)
    except nats.js.errors.APIError as exc:
        count_refusal(subject, exc)
        raise


_LIMIT_TEXTS = (("quota", "quota"), ("message size", "message-size"), ("per subject", "subject-full"), ("maximum bytes", "full"),
                ("maximum messages", "full"), ("rollup", "rollup"), ("insufficient storage", "full"))
"""Words of nats-server's answers to a write a limit refused, and the reason they count under."""


_REFUSALS_LOGGED = Sparse()


def count_refusal(subject: str, exc: nats.js.errors.APIError) -> None:
    """Count a write the server refused for a limit (JETSTREAM_REFUSED); other errors are not counted."""
    text = str(getattr(exc, "description", "") or exc).lower()
    reason = next((why for words, why in _LIMIT_TEXTS if words in text), None)
    if reason is not None:
        kind = subject.split(".")[1] if subject.startswith("$KV.") else ".".join(subject.split(".")[:3])
        JETSTREAM_REFUSED.labels(kind, reason).inc()
        skipped = _REFUSALS_LOGGED.due(f"{kind}/{reason}")
        if skipped is not None:
            log.warning("JetStream refused a write for a limit", subject=subject, reason=reason, error=text,
                        not_logged_since=skipped)


class NatsTLS(msgspec.Struct, frozen=True, kw_only=True):
    """How a client proves who it is and checks the server, beyond user/password.

    `ca_file`: verify the server's certificate against this CA (a tls:// URL without it uses the
    system CAs). `cert_file`/`key_file`: a client certificate (servers with `verify: true`).
    `creds_file`: a NATS .creds file (user JWT + NKEY seed, from `gpu-dra nats credentials`); with
    it no password is sent and the user name only names the client's inbox prefix and dead-letter
    subjects (when no user is given, the JWT's name does). `token_file`: a projected ServiceAccount
    token (audience `nats`) sent as the auth token with the sentinel's creds, for the auth callout
    (services/authcallout) to decide who the client is; the user name is the identity asked for
    (`preparer.<node>`), and the file is read again at every connect, as the kubelet rotates it."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    creds_file: str = ""
    token_file: str = ""

    @property
    def signs(self) -> bool:
        return bool(self.creds_file)

    def _context(self) -> ssl.SSLContext | None:
        if not (self.ca_file or self.cert_file or self.key_file):
            return None
        if bool(self.cert_file) != bool(self.key_file):
            raise BusError("a NATS client certificate needs both GPU_DRA_NATS_TLS_CERT and GPU_DRA_NATS_TLS_KEY")
        try:
            context = ssl.create_default_context(cafile=self.ca_file or None)
            if self.cert_file:
                context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise BusError(f"cannot load the NATS TLS files ({exc}); check GPU_DRA_NATS_TLS_CA/_CERT/_KEY") from exc
        return context

    def _creds(self) -> Creds:
        try:
            with open(self.creds_file, encoding="utf-8") as handle:
                return Creds(handle.read())
        except OSError as exc:
            raise BusError(f"cannot read NATS credentials {self.creds_file} ({exc}); mount the Secret that "
                           "`gpu-dra nats credentials` wrote, or set GPU_DRA_NATS_CREDS to its file") from exc
        except CredsError as exc:
            raise BusError(f"NATS credentials {self.creds_file} are not usable ({exc}); write them again "
                           "with `gpu-dra nats credentials`") from exc

    async def connect_options(self) -> tuple[dict[str, Any], str | None]:
        """nats-py connect() keyword arguments and the creds' user name (files read off the event loop)."""
        options: dict[str, Any] = {}
        context = await asyncio.to_thread(self._context)
        if context is not None:
            options["tls"] = context
        if not self.creds_file:
            if self.token_file:
                raise BusError("GPU_DRA_NATS_TOKEN_FILE needs GPU_DRA_NATS_CREDS: the sentinel's creds "
                               "(Secret gpu-dra-nats-sentinel) that route the connect to the auth callout")
            return options, None
        creds = await asyncio.to_thread(self._creds)
        options["user_jwt_cb"], options["signature_cb"] = creds.callbacks()
        if self.token_file:
            await asyncio.to_thread(self._token)  # a missing token fails now, with its name
            options["token"] = self._token
            return options, None  # the sentinel's name is not the client's identity
        return options, creds.name or None

    def _token(self) -> str:
        """The ServiceAccount token as it is now (nats-py asks at every connect, so a rotated token
        is used from the next reconnect on; a few hundred bytes from the kubelet's tmpfs)."""
        try:
            with open(self.token_file, encoding="utf-8") as handle:
                return handle.read().strip()
        except OSError as exc:
            raise BusError(f"cannot read the NATS token {self.token_file} ({exc}); mount a projected "
                           "ServiceAccount token with audience nats there (deploy/kubernetes/base/node-agents.yaml)"
                           ) from exc


@dataclass
class MsgContext:
    """What a handler may want besides the decoded message."""

    subject: str
    headers: dict[str, str] = field(default_factory=dict)
    raw: Msg | None = None


Handler = Callable[[M, MsgContext], Awaitable[None]]
RequestHandler = Callable[[M], Awaitable[Message]]


def encode(message: Message) -> bytes:
    return _ENCODER.encode(message)


def consumer_token(name: str) -> str:
    """A consumer name made safe as one subject token and durable name."""
    return _CONSUMER_NAME.sub("_", name) or "consumer"


def identity_token(user: str) -> str:
    """The subject token of a NATS user (`preparer.gpu-a` -> `preparer_gpu-a`): its inbox prefix and
    dead-letter subjects carry it, and its permissions name it."""
    return consumer_token(user)


def url_user(url: str) -> str | None:
    """The user named in a NATS URL's credentials (`nats://user:pass@host`), first server first."""
    for server in url.split(","):
        name = urllib.parse.urlsplit(server.strip()).username
        if name:
            return urllib.parse.unquote(name)
    return None


def node_identity(user: str | None) -> tuple[str, str] | None:
    """(role, node) of a node service's NATS user (`preparer.gpu-a`), None for any other user."""
    role, _, node = (user or "").partition(".")
    return (role, node) if role in NODE_ROLES and node else None


def inbox_prefix(user: str | None) -> str:
    """Where a client takes replies: `_INBOX_<identity>` for a named user, nats' default otherwise."""
    return f"_INBOX_{identity_token(user)}" if user else "_INBOX"


_AUTO_CONSUMER = "flt"


class _FilterInCreateSubject(JetStreamManager):
    """Consumer creation that names every unnamed, non-durable consumer with one filter subject.

    nats-py's KV watch, keys() and ephemeral subscriptions create unnamed consumers through
    `$JS.API.CONSUMER.CREATE.<stream>`, a subject that does not show what they read. A named consumer
    is created through `$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`, and the server refuses a
    create whose filter differs from the subject's: permissions on that subject decide which keys a
    node may watch and which namespaces a reader may follow. A fresh name each time also lets an
    ordered consumer's reset create its replacement."""

    async def add_consumer(
        self, stream: str, config: ConsumerConfig | None = None, timeout: float | None = None, **params: Any
    ) -> ConsumerInfo:
        if (config is not None and not config.durable_name and not config.filter_subjects
                and config.filter_subject not in (None, "", ">")
                and (config.name is None or config.name.startswith(_AUTO_CONSUMER))):  # a caller's name stays
            config.name = f"{_AUTO_CONSUMER}{uuid.uuid4().hex}"
        return await super().add_consumer(stream, config, timeout, **params)


class _BusJetStream(_FilterInCreateSubject, JetStreamContext):
    """The bus's JetStream context: its subscribe() creates consumers through _FilterInCreateSubject.

    A node's services (`<role>.<node>`) make no JetStream call themselves: their context's API prefix is
    the state gate's (`dra.v1.gate.<node>.<role>`, nats-py's own prefix option, as for another account's
    JetStream), and a message to store is sent to the gate as `<prefix>.PUB.<subject>`; the gate checks and
    makes the call, and its answer is the server's (services/stategate)."""

    def __init__(self, nc: NatsClient, *, gated: str | None = None) -> None:
        super().__init__(nc, prefix=gated or "$JS.API")
        self._gated = gated

    def _stored_at(self, subject: str) -> str:
        return f"{self._gated}.PUB.{subject}" if self._gated else subject

    async def publish(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        return await super().publish(self._stored_at(subject), *args, **kwargs)

    async def publish_async(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        return await super().publish_async(self._stored_at(subject), *args, **kwargs)

    @property
    def _jsm(self) -> JetStreamManager:
        return _FilterInCreateSubject(conn=self._nc, prefix=self._prefix, timeout=self._timeout)


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
    value it reads (a get or a watch delivery) by key: nats-py's KV entries drop the headers."""

    MAX_KEYS = 100_000  # bounded: one short string a key; cleared if a bucket ever holds more

    def __init__(self, js: JetStreamContext, prefix: str) -> None:
        self._js = js
        self._prefix = prefix
        self._consumer = f"kv:{prefix.split('.')[1]}"  # bounded: one per bucket
        self.traceparents: dict[str, str] = {}
        self.relayed: dict[tuple[str, int], str] = {}  # (key, revision) delivered with a relay's marks: why

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    def _keep(self, subject: str | None, headers: dict[str, str] | None) -> None:
        if not subject or not subject.startswith(self._prefix):
            return
        key = subject[len(self._prefix):]
        traceparent = (headers or {}).get("traceparent", "")
        if not traceparent:
            self.traceparents.pop(key, None)  # a write from outside the bus
            return
        if len(self.traceparents) >= self.MAX_KEYS:
            self.traceparents.clear()
        self.traceparents[key] = traceparent

    async def publish(self, subject: str, payload: bytes = b"", *args: Any, headers: dict[str, str] | None = None,
                      **kwargs: Any) -> Any:
        """nats-py's own KV writes (delete, purge): with the caller's trace context, like TypedKV.put."""
        publish: Any = self._js.publish
        return await publish(subject, payload, *args, headers=inject_headers(headers) or headers, **kwargs)

    async def get_msg(self, *args: Any, **kwargs: Any) -> Any:
        msg = await self._js.get_msg(*args, **kwargs)
        self._keep(msg.subject, msg.headers)
        return msg

    async def subscribe(self, *args: Any, cb: Callable[[Msg], Awaitable[None]] | None = None, **kwargs: Any) -> Any:
        subscribe: Any = self._js.subscribe
        if cb is None:
            return await subscribe(*args, **kwargs)
        delivered = cb
        listing = bool(kwargs.get("headers_only"))  # keys(): a one-off listing, not a consumer to watch

        async def keeping(msg: Msg) -> None:
            self._keep(msg.subject, msg.headers)
            why = natsorigin.relayed(None, msg.headers)  # stored headers, as delivered: a relay stored here
            if why and msg.subject and msg.subject.startswith(self._prefix):
                if len(self.relayed) >= self.MAX_KEYS:
                    self.relayed.clear()
                with contextlib.suppress(nats.errors.NotJSMessageError):
                    self.relayed[(msg.subject[len(self._prefix):], msg.metadata.sequence.stream)] = why
            if not listing:
                _note_pending(self._consumer, msg)
            await delivered(msg)

        return await subscribe(*args, cb=keeping, **kwargs)


class TypedKV(Generic[M]):
    """A JetStream KV bucket whose values are one message type."""

    def __init__(self, bus: Bus, bucket: Bucket) -> None:
        self._bus = bus
        self.bucket = bucket
        # Reads go through direct get of the one key ($JS.API.DIRECT.GET.<stream>.<key subject>),
        # the read a per-node permission can name; STREAM.MSG.GET is not allowed to node users.
        stream = f"KV_{bucket.name}"
        self._js = _KeepingContext(bus.js, f"$KV.{bucket.name}.")
        self._kv = KeyValue(name=bucket.name, stream=stream, pre=f"$KV.{bucket.name}.", js=self._js,  # type: ignore[arg-type]
                            direct=True)
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

    @property
    def raw(self) -> KeyValue:
        """The bucket as nats-py's KeyValue (untyped), reading through this TypedKV (contexts kept)."""
        return self._kv

    @contextlib.contextmanager
    def consume(self, key: str) -> Iterator[trace.Span]:
        """A consumer span for acting on the value last read of `key`: the child of the span that wrote
        it (its `traceparent`, kept from the read), a root when the writer sent none."""
        parent = traceparent_context(self._js.traceparents.get(key, ""))
        with tracer.start_as_current_span(f"consume {self.bucket.name}", context=parent, kind=SpanKind.CONSUMER,
                                          attributes={"messaging.system": "nats",
                                                      "messaging.destination.name": f"$KV.{self.bucket.name}.{key}"},
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
        """Keys matching `pattern` (a node user may list only its own node's keys)."""
        try:
            watcher = await retry_jetstream(
                lambda: self._kv.watch(pattern, ignore_deletes=True, meta_only=True), f"KV keys of {self.bucket.name}"
            )
        except nats.js.errors.NoKeysError:
            return []
        keys: list[str] = []
        try:
            async for entry in watcher:
                if not entry:
                    break
                keys.append(entry.key)
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]
        return keys

    async def items(self, pattern: str = ">") -> dict[str, M]:
        out: dict[str, M] = {}
        for key in await self.keys(pattern):
            value = await self.get(key)
            if value is not None:
                out[key] = value
        return out

    async def watch(self, keys: str = ">", *, refused_as_none: bool = False,
                    ) -> AsyncGenerator[tuple[str, M | None], None]:
        """Current values, then every change: (key, value) with value None for a delete.

        An empty marker (key "") separates the initial values from live updates. A value that does not
        decode, names another identity, or was stored by the server relaying someone's answer onto the
        key (shared.natsorigin) is refused and skipped: it never replaces the last good value. The key's
        owner, which restores what it wrote, asks to see it as None (`refused_as_none`)."""
        watcher = await retry_jetstream(lambda: self._kv.watch(keys), f"KV watch {self.bucket.name}/{keys}")
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=3600)  # type: ignore[no-untyped-call]
                except nats.errors.TimeoutError:
                    continue
                raise_if_cancelling()  # updates() is a wait_for, which can drop a cancellation
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
            await watcher.stop()  # type: ignore[no-untyped-call]

    def accepted(self, key: str, raw: bytes | None, revision: int) -> M | None:
        """A watched value, or None when it is refused (relayed here by the server, undecodable, or
        another identity's): the caller keeps the last good value."""
        why = self._js.relayed.pop((key, revision), "")
        if why:
            where = f"$KV.{self.bucket.name}.{key}"
            log.warning("KV value stored by a server relay refused", key=where, why=why)
            self._bus.spawn(self._bus.dead_letter(where, raw or b"", self._bus.name, f"stored by {why}",
                                                  reason=natsorigin.RELAYED))
            return None
        return self.decode(key, raw, revision)


class Bus:
    """A connected NATS client with JetStream, bound to the event catalog."""

    def __init__(self, nc: NatsClient, name: str, *, replicas: int = 1, user: str | None = None) -> None:
        self.nc = nc
        self.replicas = replicas
        self.name = name
        self.identity = identity_token(user) if user else consumer_token(name)
        self.user = user  # the NATS user it logged in as (None: no authentication, no identities to check)
        node_role = node_identity(user)
        self.js: JetStreamContext = _BusJetStream(nc, gated=gate_prefix(node_role[1], node_role[0])
                                                  if node_role else None)
        self._subs: list[Subscription] = []
        self._kv_cache: dict[str, TypedKV[Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._reconnect_callbacks: list[Callable[[], None]] = []

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after every reconnect. Core subscriptions come back by themselves but miss
        what was published while the connection was away; a consumer re-reads its state here."""
        self._reconnect_callbacks.append(callback)

    def _reconnected(self) -> None:
        for callback in list(self._reconnect_callbacks):
            try:
                callback()
            except Exception:  # noqa: BLE001 - one listener must not stop the others
                log.exception("reconnect callback failed", client=self.name)

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str,
        connect_timeout: float = 2.0,
        initial_attempts: int = 30,
        login_attempts: int = 3,
        reconnect_wait: float = 0.25,
        user: str | None = None,
        password: str | None = None,
        replicas: int = 1,
        tls: NatsTLS | None = None,
    ) -> Bus:
        """Connect with backoff; once connected, reconnect forever on loss.

        A server that cannot be reached is tried `initial_attempts` times (backoff 0.1 s doubling to
        2 s). A server that refuses the login (wrong password, unknown user, revoked or foreign
        creds) is tried `login_attempts` times, then BusError says what was refused, for which user
        or creds file, and what to do: the service exits non-zero instead of waiting forever.
        `replicas` is how many copies provision() asks for when it creates a stream or bucket.
        `user` also names the client's inbox prefix (`_INBOX_<identity>`); `tls` adds a CA, a client
        certificate, a NATS .creds file or an NKEY seed file (see NatsTLS)."""
        tls = tls or NatsTLS()
        options, creds_user = await tls.connect_options()
        if user and creds_user and user != creds_user:
            raise BusError(f"GPU_DRA_NATS_USER is {user!r} but the creds file is for {creds_user!r}: the inbox and "
                           "dead-letter subjects would not be the ones its permissions allow; fix either one")
        identity = user or creds_user or url_user(url)
        if tls.token_file and not user:
            raise BusError("GPU_DRA_NATS_TOKEN_FILE needs GPU_DRA_NATS_USER: the identity the auth callout is "
                           "asked for (e.g. preparer.<node>)")
        login = None if tls.signs else user

        async def on_disconnect() -> None:
            if not (nc.is_closed or nc.is_draining):  # our own close() is no news
                log.warning("nats disconnected", client=name)
                NATS_CONNECTED.labels(name).set(0)

        connected: list[Bus] = []  # the Bus below, once there is one

        async def on_reconnect() -> None:
            log.info("nats reconnected", client=name, server=str(nc.connected_url.netloc if nc.connected_url else ""))
            NATS_CONNECTED.labels(name).set(1)
            NATS_RECONNECTS.labels(name).inc()
            for bus in connected:
                bus._reconnected()

        dial_errors: list[Exception] = []  # the last dial's error (nats-py reports it here, then "no servers")

        async def on_error(exc: Exception) -> None:
            dial_errors[:] = [exc]
            log.warning("nats error", client=name, error=str(exc) or type(exc).__name__)

        def refused_login(exc: Exception) -> bool:
            text = str(exc).lower()
            return isinstance(exc, nats.errors.Error) and ("authorization violation" in text
                                                           or "authentication" in text)

        def who() -> str:
            if tls.token_file:
                return f"the token in {tls.token_file} asking the auth callout for user {identity!r}"
            if tls.creds_file:
                return f"creds file {tls.creds_file} (user {creds_user!r})"
            if login:
                return f"user {login!r} (GPU_DRA_NATS_USER with GPU_DRA_NATS_PASSWORD)"
            if identity:
                return f"user {identity!r} (from GPU_DRA_NATS_URL)"
            return "an anonymous client (neither GPU_DRA_NATS_USER nor GPU_DRA_NATS_CREDS is set)"

        servers = url.split(",")
        shown = re.sub(r"//[^/@,]*@", "//", url)  # no password in an error message
        backoff = Backoff(initial_s=0.1, cap_s=2.0)
        last_error: Exception | None = None
        unreachable = refusals = 0
        while True:
            nc = NatsClient()
            try:
                # A bounded try per attempt (a refused login raises at once, an unreachable pool after two
                # dials per server): this loop decides whether to try again, with its backoff.
                await nc.connect(
                    servers=servers,
                    # with a token the connection's name is the identity asked of the auth callout
                    name=identity if tls.token_file else name,
                    connect_timeout=int(max(1, connect_timeout)),
                    reconnect_time_wait=reconnect_wait,  # type: ignore[arg-type]
                    max_reconnect_attempts=1,
                    allow_reconnect=False,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    error_cb=on_error,
                    user=login,
                    password=password if login else None,
                    ping_interval=5,
                    max_outstanding_pings=2,
                    inbox_prefix=inbox_prefix(identity),
                    **options,
                )
            except Exception as exc:  # noqa: BLE001 - classified just below
                last_error = exc
                try:
                    await nc.close()  # a failed first try leaves its socket open
                except Exception:  # noqa: BLE001 - closing a half-open client is best effort
                    log.debug("closing a failed NATS client failed", client=name)
                if refused_login(exc):
                    refusals += 1
                    if refusals >= max(1, login_attempts):
                        raise LoginRefused(
                            f"NATS at {shown} refused the login of {who()} {refusals} times ({exc}): the "
                            "password or creds do not match a user the server knows, or the user was revoked; "
                            "give this service the credentials `gpu-dra nats credentials` wrote for it (its "
                            "Secret), re-run that command if the user was rotated, then restart it"
                        ) from None
                else:
                    unreachable += 1
                    if isinstance(exc, nats.errors.NoServersError) and dial_errors:
                        last_error = dial_errors[0]
                    if unreachable >= max(1, initial_attempts):
                        raise BusError(
                            f"cannot connect to NATS at {shown} after {unreachable} attempts: "
                            f"{str(last_error) or type(last_error).__name__}; "
                            "check GPU_DRA_NATS_URL and that the server is up"
                        ) from None
                await asyncio.sleep(backoff.next())
                continue
            # once in, a lost connection is redialled forever (nats-py reads these at each disconnect)
            nc.options["allow_reconnect"] = True
            nc.options["max_reconnect_attempts"] = -1
            connected.append(cls(nc, name, replicas=replicas, user=identity))
            NATS_CONNECTED.labels(name).set(1)
            return connected[0]

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
        for stream in STREAMS:
            await retry_jetstream(functools.partial(self._provision_stream, stream), f"provision stream {stream.name}")
        for bucket in BUCKETS:
            await self._bucket(bucket)
            await retry_jetstream(functools.partial(self._limit_bucket, bucket), f"limit bucket {bucket.name}")

    async def _provision_stream(self, stream: Stream) -> None:
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
        )
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await self.js.update_stream(config)

    async def _limit_bucket(self, bucket: Bucket) -> None:
        """The bucket's stream with the catalog's limits: no rollup header (a `Nats-Rollup: all` on one's
        own key would erase every key), value size and bucket size bounded."""
        info = await self.js.stream_info(f"KV_{bucket.name}")
        config = info.config
        want = {"allow_rollup_hdrs": False, "max_msg_size": bucket.max_value_size, "max_bytes": bucket.max_bytes}
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
                    raise BusError(f"KV bucket {bucket.name} does not exist after {PUBLISH_RETRY_S:.0f}s: the "
                                   "publisher (or the deployment's init, as admin) creates it; is it running?") from None
                log.info("KV bucket not provisioned yet; waiting for the publisher", bucket=bucket.name)
                await asyncio.sleep(backoff.next())

    async def _bucket_once(self, bucket: Bucket) -> KeyValue:
        try:
            kv = await self.js.key_value(bucket.name)
            if not kv._direct:  # noqa: SLF001 - nats-py's record of the stream's allow_direct
                await self._enable_direct_get(bucket)
            return kv
        except nats.js.errors.BucketNotFoundError:
            try:
                return await self.js.create_key_value(
                    KeyValueConfig(
                        bucket=bucket.name, history=bucket.history, ttl=bucket.ttl_s or None, replicas=self.replicas,
                        direct=True,  # TypedKV reads by direct get only
                        max_value_size=bucket.max_value_size, max_bytes=bucket.max_bytes,
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
            log.warning("KV bucket has no direct get and this user cannot enable it; reads fail until the "
                        "publisher starts (or run `nats stream edit --allow-direct`)", bucket=bucket.name,
                        stream=stream, error=str(exc) or type(exc).__name__)

    async def kv(self, bucket: Bucket) -> TypedKV[Any]:
        """The typed KV bucket (created if missing)."""
        cached = self._kv_cache.get(bucket.name)
        if cached is None:
            await self._bucket(bucket)  # created if missing, direct get turned on if it can be
            cached = TypedKV(self, bucket)
            self._kv_cache[bucket.name] = cached
        return cached

    @contextlib.contextmanager
    def _outgoing(self, entry: Entry, message: Message, msg_id: str | None, durable: bool,
                  tokens: dict[str, str]) -> Iterator[tuple[str, bytes, dict[str, str]]]:
        """An event's subject, body and headers, inside its producer span (which ends with the block)."""
        if not isinstance(message, entry.message):
            raise TypeError(f"{entry.name} carries {entry.message.__name__}, not {type(message).__name__}")
        subject = entry.format(**tokens)
        with tracer.start_as_current_span(f"publish {entry.name}", kind=SpanKind.PRODUCER, attributes={
                "messaging.system": "nats", "messaging.destination.name": subject}):
            # every durable publish carries a message id, so a retry is de-duplicated by the stream; the
            # id (given or drawn) is also the CloudEvents id of an event that has no event id of its own
            event_id = msg_id or uuid.uuid4().hex
            headers = cloudevents.headers(entry, message, subject, event_id, self.name)
            if msg_id or durable:
                headers["Nats-Msg-Id"] = event_id
            yield subject, encode(message), inject_headers(headers)

    async def publish(
        self, entry: Entry, message: Message, *, msg_id: str | None = None, durable: bool = True, **tokens: str
    ) -> None:
        """Publish an event. Durable events go through JetStream (stored, de-duplicated by msg_id)."""
        with self._outgoing(entry, message, msg_id, durable, tokens) as (subject, payload, headers):
            if durable:
                await publish_with_retry(self.js, subject, payload, headers)
            else:
                await self.nc.publish(subject, payload, headers=headers)

    async def publish_nowait(self, entry: Entry, message: Message, *, msg_id: str, **tokens: str,
                             ) -> asyncio.Future[Any]:
        """Send a durable event to JetStream without waiting for its store: the future of its ack (a
        JetStream error or NoStreamResponseError as its exception; await it with a timeout). For a sender
        that has many in flight at once; the publish span ends when the message is sent."""
        with self._outgoing(entry, message, msg_id, True, tokens) as (subject, payload, headers):
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
        **tokens: str,
    ) -> Subscription:
        """Call `handler(message, ctx)` for each message on the entry's subjects.

        `durable`: a JetStream durable consumer of that name (replays what it has not acked,
        survives restarts); without it, a core NATS subscription (live messages only).
        """
        decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(entry.message)
        subject = entry.wildcard(**tokens)
        consumer = durable or self.name

        async def on_message(msg: Msg) -> None:
            headers = dict(msg.headers or {})
            if durable:
                _note_pending(consumer, msg)
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
            with tracer.start_as_current_span(
                f"consume {entry.name}", context=parent, kind=SpanKind.CONSUMER
            ) as span:
                span.set_attribute("messaging.system", "nats")
                span.set_attribute("messaging.destination.name", msg.subject)
                try:
                    await handler(message, MsgContext(subject=msg.subject, headers=headers, raw=msg))
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
        else:
            sub = await self.nc.subscribe(subject, queue=queue or "", cb=on_message)
        self._subs.append(sub)
        return sub

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
                    f"no reply on {subject} within {timeout}s ({type(exc).__name__}): is the service for this node running?"
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
