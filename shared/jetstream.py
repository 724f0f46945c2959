"""JetStream as the bus uses it: calls retried through a leader change or reconnect, writes a limit refused
counted, and the bus's context, whose consumers carry their filter in the create subject and whose stores
go through a node's state gate.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    ConsumerInfo,
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
    ordered consumer's reset create its replacement."""

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
