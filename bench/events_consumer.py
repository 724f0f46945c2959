"""A third party's consumer of claim events, as docs/events.md tells one to write it (imports nothing of ours).

Connects as its reader identity (`reader.<name>`: its .creds and its own inbox prefix `_INBOX_reader_<name>`),
creates its own durable pull consumer (named `reader_<name>`, the one durable a reader owns) with its
filter in the create subject, ack policy `all` and deliver-all, binds to it, then fetches batches and, once a
batch is processed, acks it with one ack (its newest message's). Records per message the latency from the
event's `observed_at` (the producer's clock; same host here) and from the stream's timestamp of it (stored: the
publish's ack) to the moment the batch was delivered, and each `ce-id` seen, so loss and duplicates after ack
can be counted. `rate` > 0 makes it a slow consumer: it processes at most `rate` messages a second.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats
import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

STREAM = "DRA_EVENTS"
# a slow consumer sleeps off its work in steps this long, not per message: a timer a message cost it ~90 µs of
# CPU an event (119 against a fast one's 29), taken from the cores the publishers and nats-server share with it
SLOW_STEP_S = 0.01


class _Claim(msgspec.Struct):
    """The fields of a claim event (ClaimLifecycle.json) this consumer reads; the rest are skipped unread."""

    event_id: str
    claim_uid: str
    observed_at: float


_read_claim = msgspec.json.Decoder(_Claim).decode


@dataclass(frozen=True)
class ConsumerSpec:
    name: str  # the reader's name: user reader.<name>, durable reader_<name>
    creds: str  # its .creds file
    url: str
    filter_subject: str  # inside the namespaces it was granted, e.g. dra.v1.claim.team-a.>
    rate: float = 0.0  # processing rate (messages/s) of a slow consumer; 0: as fast as it can
    batch: int = 256
    # a fetch returns once the batch is full or this has passed (nats-py waits for the rest of a batch once one
    # message came): the delay batching may add to an event's delivery
    fetch_timeout_s: float = 0.1
    max_ack_pending: int = 1024  # >= batch: a fetch is never cut short by what is not acked yet
    give_up_s: float = 30.0  # told the total, and no new event for this long: stop and report what is missing
    # pull: batches fetched (the recipe); push: the server delivers to a subject of the reader's inbox with flow
    # control, and a callback takes each message (no fetch task per message: ~40% less CPU in nats-py)
    mode: str = "pull"


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class _Tally:
    """What a consumer saw: each `ce-id`, the latencies of first sights, duplicates, and messages that do not
    carry their claim's trace (the bench's publisher gives a claim's trace the id of its uid)."""

    seen: set[str] = field(default_factory=set)
    latencies_ms: list[float] = field(default_factory=list)  # from the event's observed_at (the preparer's)
    stored_ms: list[float] = field(default_factory=list)  # from the stream's timestamp (the publish's ack)
    duplicates: int = 0
    untraced: int = 0
    first_at: float = 0.0
    last_at: float = 0.0  # the last ack

    def note(self, msg: Msg, delivered: float) -> None:
        event = _read_claim(msg.data)
        headers = msg.headers or {}
        event_id = headers.get("ce-id") or event.event_id
        self.untraced += headers.get("traceparent", "")[3:35] != event.claim_uid
        if event_id in self.seen:
            self.duplicates += 1
        else:
            self.seen.add(event_id)
            self.latencies_ms.append((delivered - event.observed_at) * 1000)
            self.stored_ms.append((delivered - msg.metadata.timestamp.timestamp()) * 1000)
        self.first_at = self.first_at or delivered


async def consume(
    spec: ConsumerSpec, ready: Callable[[], None], total: asyncio.Future[int], gate: asyncio.Event | None = None
) -> dict[str, Any]:
    """Create the durable, call `ready()`, consume until `total` (told once the publisher is done) distinct
    events were seen, or nothing new came for `give_up_s`. `gate`: no batch is acked before it is set."""
    durable = f"reader_{spec.name}"
    nc = await nats.connect(
        spec.url, user_credentials=spec.creds, inbox_prefix=f"_INBOX_reader_{spec.name}", name=durable
    )
    js = nc.jetstream()
    config = ConsumerConfig(
        name=durable,
        durable_name=durable,
        filter_subject=spec.filter_subject,
        ack_policy=AckPolicy.ALL,
        deliver_policy=DeliverPolicy.ALL,
        max_ack_pending=spec.max_ack_pending,
        ack_wait=30.0,
    )
    if spec.mode == "push":  # delivered to the reader's own inbox space, paced by flow control and heartbeats
        config.deliver_subject = f"_INBOX_reader_{spec.name}.deliver"
        config.flow_control, config.idle_heartbeat = True, 5.0
    await js.add_consumer(STREAM, config)  # through $JS.API.CONSUMER.CREATE.DRA_EVENTS.<name>.<filter>
    cpu0 = _cpu()
    tally = _Tally()
    seen = tally.seen

    async def ack(batch: list[Msg]) -> None:  # processed, in order: one ack (ack_policy=all)
        if gate is not None:
            await gate.wait()
        await max(batch, key=lambda m: m.metadata.sequence.stream).ack()
        tally.last_at = time.time()

    def finished(idle_s: float) -> bool:  # told the total: every event seen, or nothing new for give_up_s
        return total.done() and (len(seen) >= total.result() or idle_s > spec.give_up_s)

    loop = asyncio.get_running_loop()
    if spec.mode == "push":
        await _push(js, spec, durable, config, tally.note, ack, finished, ready)
    else:
        sub = await js.pull_subscribe_bind(durable, stream=STREAM)
        ready()
        idle_since = loop.time()
        while not finished(loop.time() - idle_since):
            try:
                msgs = await sub.fetch(spec.batch, timeout=spec.fetch_timeout_s)
            except (TimeoutError, nats.errors.TimeoutError):
                continue  # an idle stream; not an error (docs/events.md)
            delivered = time.time()
            for msg in msgs:
                tally.note(msg, delivered)
            if spec.rate:  # a slow consumer's work: 1/rate seconds an event
                await asyncio.sleep(len(msgs) / spec.rate)
            if msgs:  # a crash before the ack redelivers the batch
                await ack(msgs)
            idle_since = loop.time()
    await nc.flush()
    await nc.close()
    return {
        "name": spec.name,
        "slow_rate": spec.rate,
        "received": len(seen) + tally.duplicates,
        "distinct": len(seen),
        "missing": (total.result() if total.done() else -1) - len(seen),
        "duplicates": tally.duplicates,
        "without_claims_traceparent": tally.untraced,
        "latency_ms": _figures(tally.latencies_ms),
        "stored_to_delivered_ms": _figures(tally.stored_ms),
        "first_at": tally.first_at,
        "last_at": tally.last_at,
        "cpu_s": round(_cpu() - cpu0, 2),
    }


async def _push(
    js: Any,
    spec: ConsumerSpec,
    durable: str,
    config: ConsumerConfig,
    note: Callable[[Msg, float], None],
    ack: Callable[[list[Msg]], Awaitable[None]],
    finished: Callable[[float], bool],
    ready: Callable[[], None],
) -> None:
    """Push delivery: the callback notes each message and acks every `batch` of them; a batch cut short by a
    quiet `fetch_timeout_s` is acked then."""
    pending: list[Msg] = []
    arrived = asyncio.Event()
    owed_s = 0.0  # a slow consumer's work not yet slept off

    async def take(batch: list[Msg]) -> None:
        pending.clear()
        await ack(batch)

    async def on_message(msg: Msg) -> None:
        nonlocal owed_s
        note(msg, time.time())
        if spec.rate:  # a slow consumer's work: 1/rate seconds an event, slept off in steps of SLOW_STEP_S
            owed_s += 1 / spec.rate
            if owed_s >= SLOW_STEP_S:
                await asyncio.sleep(owed_s)
                owed_s = 0.0
        pending.append(msg)
        arrived.set()
        if len(pending) >= spec.batch:
            await take(pending[:])

    sub = await js.subscribe_bind(STREAM, config, durable, cb=on_message, manual_ack=True)
    ready()
    loop = asyncio.get_running_loop()
    idle_since = loop.time()
    try:
        while not finished(loop.time() - idle_since):
            arrived.clear()
            try:
                await asyncio.wait_for(arrived.wait(), spec.fetch_timeout_s)
                idle_since = loop.time()
            except TimeoutError:
                if pending:
                    await take(pending[:])
    finally:
        await sub.unsubscribe()


def _figures(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(_quantile(values, 0.50), 1),
        "p99": round(_quantile(values, 0.99), 1),
        "max": round(max(values, default=0.0), 1),
    }


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
