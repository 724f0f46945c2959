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
import json
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

STREAM = "DRA_EVENTS"


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


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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
    await js.add_consumer(STREAM, config)  # through $JS.API.CONSUMER.CREATE.DRA_EVENTS.<name>.<filter>
    sub = await js.pull_subscribe_bind(durable, stream=STREAM)
    cpu0 = _cpu()
    ready()
    seen: set[str] = set()
    latencies_ms: list[float] = []  # from the event's observed_at (minted by the preparer)
    stored_ms: list[float] = []  # from the stream's timestamp (JetStream stored it: the publish's ack)
    duplicates = untraced = 0
    first_at = last_at = 0.0
    loop = asyncio.get_running_loop()
    idle_since = loop.time()
    while not (total.done() and (len(seen) >= total.result() or loop.time() - idle_since > spec.give_up_s)):
        try:
            msgs = await sub.fetch(spec.batch, timeout=spec.fetch_timeout_s)
        except (TimeoutError, nats.errors.TimeoutError):
            continue  # an idle stream; not an error (docs/events.md)
        delivered = time.time()
        first_at = first_at or delivered
        for msg in msgs:
            event = json.loads(msg.data)
            headers = msg.headers or {}
            event_id = headers.get("ce-id") or event["event_id"]
            untraced += "traceparent" not in headers
            if event_id in seen:
                duplicates += 1
            else:
                seen.add(event_id)
                latencies_ms.append((delivered - float(event["observed_at"])) * 1000)
                stored_ms.append((delivered - msg.metadata.timestamp.timestamp()) * 1000)
        if spec.rate:  # a slow consumer's work: 1/rate seconds an event
            await asyncio.sleep(len(msgs) / spec.rate)
        if gate is not None:
            await gate.wait()
        if msgs:  # processed, in order: one ack for the batch (ack_policy=all; a crash before it redelivers it)
            await max(msgs, key=lambda m: m.metadata.sequence.stream).ack()
        last_at = time.time()
        idle_since = loop.time()
    await nc.flush()
    await nc.close()
    return {
        "name": spec.name,
        "slow_rate": spec.rate,
        "received": len(seen) + duplicates,
        "distinct": len(seen),
        "missing": (total.result() if total.done() else -1) - len(seen),
        "duplicates": duplicates,
        "without_traceparent": untraced,
        "latency_ms": _figures(latencies_ms),
        "stored_to_delivered_ms": _figures(stored_ms),
        "first_at": first_at,
        "last_at": last_at,
        "cpu_s": round(_cpu() - cpu0, 2),
    }


def _figures(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(_quantile(values, 0.50), 1),
        "p99": round(_quantile(values, 0.99), 1),
        "max": round(max(values, default=0.0), 1),
    }


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
