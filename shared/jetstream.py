"""JetStream as the bus uses it: calls retried through a leader change or reconnect, writes a limit refused
counted, and the bus's context, whose consumers carry their filter in the create subject and whose stores
go through a node's state gate.
"""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
)
from nats.js.manager import JetStreamManager
from prometheus_client import Counter

from shared.backoff import Backoff
from shared.logs import Sparse, get_logger
from shared.natsconn import BusError

log = get_logger(__name__)
JETSTREAM_RETRIES = Counter("gpu_dra_jetstream_retries", "JetStream calls retried (leader changes, reconnects)")
JETSTREAM_REFUSED = Counter(
    "gpu_dra_jetstream_refused",
    "Writes the JetStream server refused for a limit (message size, messages per "
    "subject, bucket or stream full, rollup): this identity's share is used up",
    ["subject_kind", "reason"],
)
T = TypeVar("T")


PUBLISH_RETRY_S = 30.0
"""How long a JetStream publish keeps retrying through a leader change before it gives up."""
ORDERED_HEARTBEAT_S = 5.0
"""An ordered consumer's idle heartbeat: two missed (a lost connection, a consumer gone) and it is made again."""
WATCH_INACTIVE_S = 5.0
"""How long the server keeps a watch's consumer (a KV watch, a key listing, an ordered consumer) once nobody
receives its deliveries, so that a watch stopped or ended takes its consumer with it: the server's own default
for an ephemeral consumer. nats-py's KV watch asks for 5 minutes, all counted against the stream's consumer
limit: every key listing and every reset of an ordered consumer added one for that long. A client away longer
loses it; its ordered consumer, missing the heartbeats, makes it again from where it was, as after any gap."""


def _retryable(exc: BaseException) -> bool:
    """A JetStream error that a leader change or reconnect explains (worth retrying)."""
    if isinstance(
        exc,
        (
            nats.errors.TimeoutError,
            nats.errors.NoRespondersError,
            TimeoutError,
            nats.errors.ConnectionReconnectingError,
            nats.js.errors.ServiceUnavailableError,
            nats.js.errors.NoStreamResponseError,
        ),
    ):
        return True
    if isinstance(exc, nats.js.errors.APIError):
        # KV errors (KeyNotFoundError, ...) subclass APIError without setting its fields
        code = getattr(exc, "code", None)
        text = f"{getattr(exc, 'description', '') or ''} {getattr(exc, 'err_code', '') or ''} {code or ''}"
        return "leader" in text.lower() or code == 503
    return False


async def retry_jetstream(call: Callable[[], Awaitable[T]], what: str, *, budget_s: float = PUBLISH_RETRY_S) -> T:
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
        return await retry_jetstream(
            lambda: js.publish(subject, payload, headers=headers), f"JetStream publish to {subject}", budget_s=budget_s
        )
    except nats.js.errors.APIError as exc:
        count_refusal(subject, exc)
        raise


_LIMIT_TEXTS = (
    ("quota", "quota"),
    ("message size", "message-size"),
    ("per subject", "subject-full"),
    ("maximum bytes", "full"),
    ("maximum messages", "full"),
    ("rollup", "rollup"),
    ("insufficient storage", "full"),
)
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
            log.warning(
                "JetStream refused a write for a limit",
                subject=subject,
                reason=reason,
                error=text,
                not_logged_since=skipped,
            )


_AUTO_CONSUMER = "flt"


class _FilterInCreateSubject(JetStreamManager):
    """Consumer creation that names every unnamed, non-durable consumer with one filter subject.

    nats-py's KV watch, keys() and ephemeral subscriptions create unnamed consumers through
    `$JS.API.CONSUMER.CREATE.<stream>`, a subject that does not show what they read. A named consumer
    is created through `$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`, and the server refuses a
    create whose filter differs from the subject's: permissions on that subject decide which keys a
    node may watch and which namespaces a reader may follow. A fresh name each time also lets an
    ordered consumer's reset create its replacement; the reset starts at a stream sequence, so a start
    time the first create had is dropped (the server refuses both together)."""

    async def add_consumer(
        self, stream: str, config: ConsumerConfig | None = None, timeout: float | None = None, **params: Any
    ) -> ConsumerInfo:
        if (
            config is not None
            and not config.durable_name
            and not config.filter_subjects
            and config.filter_subject not in (None, "", ">")
            and (config.name is None or config.name.startswith(_AUTO_CONSUMER))
        ):  # a caller's name stays
            config.name = f"{_AUTO_CONSUMER}{uuid.uuid4().hex}"
        if config is not None and config.deliver_policy == DeliverPolicy.BY_START_SEQUENCE:
            config.opt_start_time = None
        return await super().add_consumer(stream, config, timeout, **params)


class BusJetStream(_FilterInCreateSubject, JetStreamContext):
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


async def ordered_consumer(
    nc: NatsClient,
    js: JetStreamContext,
    stream: str,
    subject: str,
    cb: Callable[[Msg, bool], Awaitable[None]],
    *,
    since: float | None = None,
    last_per_subject: bool = False,
    headers_only: bool = False,
) -> tuple[JetStreamContext.PushSubscription, int]:
    """`await cb(msg, replayed)` for each message of `subject` on `stream` through one ordered consumer: from the
    unix time `since` on, or each subject's last message first (`last_per_subject`: a KV watch), or all.

    Returns the subscription and its replay: how many messages the stream held for it when it was made, read from
    the create's answer. Those come first (`replayed` true), then the new ones. The count is exact: nothing is
    delivered before the answer, so no message can be in flight when it is read (a count read from the consumer's
    info after the subscription, as nats-py's KV watch does, misses deliveries already on the wire).

    nats-py's ordered consumer, made here rather than by `js.subscribe(ordered_consumer=True)` only to read that
    answer: ephemeral, in memory, one replica, no acks, flow control and idle heartbeats; after a gap or two
    missed heartbeats nats-py makes it again from the stream sequence after the last delivered, so each message
    comes once, in stream order, and none is skipped while the stream keeps it. `headers_only`: bodies left out."""
    policy = DeliverPolicy.ALL
    if since is not None:
        policy = DeliverPolicy.BY_START_TIME
    elif last_per_subject:
        policy = DeliverPolicy.LAST_PER_SUBJECT
    config = ConsumerConfig(
        filter_subject=subject,
        deliver_subject=nc.new_inbox(),
        deliver_policy=policy,
        opt_start_time=None if since is None else datetime.datetime.fromtimestamp(since, datetime.UTC),
        ack_policy=AckPolicy.NONE,
        max_deliver=1,
        flow_control=True,
        idle_heartbeat=ORDERED_HEARTBEAT_S,
        headers_only=headers_only or None,
        num_replicas=1,
        mem_storage=True,
        inactive_threshold=WATCH_INACTIVE_S,
    )
    info = await retry_jetstream(lambda: js.add_consumer(stream, config), f"ordered consumer of {subject}")
    replay = info.num_pending or 0
    backlog = replay

    async def deliver(msg: Msg) -> None:
        nonlocal backlog
        replayed = backlog > 0
        backlog -= int(replayed)
        await cb(msg, replayed)

    sub = await js.subscribe_bind(stream, config, info.name, cb=deliver, ordered_consumer=True)
    return sub, replay
