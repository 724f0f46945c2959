"""Claim events fanned out through JetStream to independent third-party consumers (issue 33), short: the
machinery of bench/events_bench.py for ~2.5 s at a low rate, in this process (the bench runs each role as a
process of its own, 10,000 events/s for 60 s).

A real nats-server as `gpu-dra up` runs it (operator/account config, .creds per identity), DRA_EVENTS as
`Bus.provision()` makes it, the preparer's own outbox and sender publishing, and two consumers as third parties
write them (docs/events.md): each a `reader.<name>` identity with its own durable consumer, pull or push. The slow one
acks nothing until the fast one has had every event, so its backlog is certain, not a matter of timing.
"""

from __future__ import annotations

import asyncio

import pytest

from bench.events_bench import RunSpec, run

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_a_slow_consumer_loses_nothing_and_holds_back_no_other_consumer(mode: str) -> None:
    gate = asyncio.Event()
    spec = RunSpec(seconds=2.5, rate=400, fast=1, slow_rate=2000, processes=False, give_up_s=10.0, consumer_mode=mode)
    out = await run(spec, slow_gate=gate)
    total = out["events"]
    fast, slow = out["consumers"]["fast1"], out["consumers"]["slow"]
    assert total > 0 and out["publish"][0]["dropped"] == 0, out["publish"]
    assert out["stream_messages"] == total, "every event published is in DRA_EVENTS"
    # the fast consumer had every event while the slow one had acked none of them
    assert fast["distinct"] == total and fast["missing"] == 0 and fast["duplicates"] == 0, fast
    assert slow["lag_when_fast_ones_done"] == total, slow
    # ...and the slow one, once it went on, lost nothing and got nothing twice
    assert slow["distinct"] == total and slow["missing"] == 0 and slow["duplicates"] == 0, slow
    assert fast["without_claims_traceparent"] == slow["without_claims_traceparent"] == 0
