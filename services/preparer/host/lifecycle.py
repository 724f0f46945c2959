"""Claim lifecycle events (`dra.v1.claim.<ns>.<node>.<event>`): minted here, kept in the outbox, sent when NATS is
there.

Owns the making of an event (its id, its `Nats-Msg-Id`) and the sender that drains the durable
outbox (`outbox.py`) to JetStream: prepare never waits on NATS, and the sender lingers `SEND_LINGER`
from the wake an event causes, so the events of a burst go out together after the kubelet's call rather
than interleaved with it (events that came while a round was in flight have lingered by its end and go
at once). Each claim's events are stored in order: the sender publishes in rounds, a
claim's n-th pending event in round n, each round's events all in flight at once (up to
`SEND_WINDOW`) and every ack awaited before the next round, so an event is sent only once the one
before it of the same claim is stored (events of different claims may be stored in any order). One
ack line is written per round, not per event; sending a round at once costs a fifth of the CPU per
event of one publish-and-wait after another. Each event's id names this
node and the preparation it belongs to (`claim_event_id`: no other node can mint one that collides
with it; each preparation of a claim has ids of its own). Its `Nats-Msg-Id` is that id plus a random
suffix drawn once per process and stored with the outbox record, so a resend (after a lost ack, or
by the next process from the outbox) is de-duplicated by JetStream, and nobody can send a message id
ahead of ours to make the stream drop our event as a duplicate. The record keeps the `traceparent`
of the span that made the event (the claim's prepare), and the sender publishes it in that context,
so the event joins the claim's trace, even when sent by the next process.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any

from services.preparer.host.outbox import DEFAULT_MAX_BYTES, DEFAULT_MAX_EVENTS, Outbox, OutboxRecord
from shared.bus import Bus
from shared.events import catalog
from shared.events.base import now_unix
from shared.events.catalog import as_token
from shared.events.claims import (
    ClaimEventKind,
    ClaimLifecycle,
    FailureReason,
    PreparedDeviceRef,
    claim_event_id,
)
from shared.logs import get_logger
from shared.telemetry import current_traceparent

log = get_logger(__name__)

SEND_WINDOW = 64  # lifecycle events in flight at once
ACK_TIMEOUT_S = 5.0  # how long a round's acks may take before the missing ones count as not stored (resent)
SEND_LINGER = 0.02  # seconds the sender waits after a wake, so the events of a burst go out in one round


def subject_token(value: str) -> str:
    """A namespace or node made safe as one subject token."""
    return as_token(value)


class LifecycleEvents:
    """Make events, and send what the outbox holds whenever a bus is there."""

    def __init__(
        self,
        node: str,
        driver: str,
        outbox_path: Path | None = None,
        *,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        linger: float = SEND_LINGER,
    ) -> None:
        self.node = node
        self.linger = linger
        self.driver = driver
        self._wake = asyncio.Event()
        self._woken_at = 0.0  # monotonic time of the wake not yet served (the first commit since the last send)
        self._drained = asyncio.Event()
        self._drained.set()
        self.outbox = Outbox(
            outbox_path, driver=driver, max_events=max_events, max_bytes=max_bytes, on_commit=self._committed
        )
        self._msg_id_suffix = secrets.token_hex(8)  # unguessable by other publishers (module docstring)
        self.sent = 0
        self.bus: Bus | None = None

    @property
    def pending(self) -> list[ClaimLifecycle]:
        """The events not yet stored by JetStream, oldest first."""
        return [r.event for r in self.outbox.pending.values() if r.event is not None]

    @property
    def dropped(self) -> int:
        return self.outbox.dropped

    def make(
        self,
        event: ClaimEventKind,
        *,
        uid: str,
        namespace: str,
        name: str,
        preparation: int,
        devices: list[PreparedDeviceRef] | None = None,
        error: str = "",
        reason: FailureReason = "",
    ) -> OutboxRecord:
        """An outbox record for one event; it is kept once a checkpoint write (or `outbox.add`) carries it."""
        event_id = claim_event_id(subject_token(self.node), uid, preparation, event)
        message = ClaimLifecycle(
            event=event,
            node=self.node,
            driver=self.driver,
            claim_uid=uid,
            claim_namespace=namespace,
            claim_name=name,
            devices=devices or [],
            error=error,
            reason=reason,
            event_id=event_id,
            observed_at=now_unix(),
        )
        return OutboxRecord(
            seq=self.outbox.next_seq(),
            msg_id=f"{event_id}/{self._msg_id_suffix}",
            preparation=preparation,
            event=message,
            traceparent=current_traceparent(),
        )

    def _committed(self) -> None:
        if self.outbox.pending:
            self._drained.clear()
        self._woke()

    def _woke(self) -> None:
        if not self._wake.is_set():
            self._woken_at = time.monotonic()
            self._wake.set()

    def attach(self, bus: Bus) -> None:
        """Send through `bus` from now on; its reconnects wake the sender (nothing is sent while it is away)."""
        self.bus = bus
        bus.on_reconnect(self._woke)
        self._woke()

    async def drained(self) -> None:
        """Until every event in the outbox has been sent."""
        await self._drained.wait()

    def _rounds(self) -> list[list[tuple[int, OutboxRecord]]]:
        """What is pending, in rounds: a claim's n-th pending event goes in round n (so it is sent once the
        one before it is stored); a round is at most SEND_WINDOW events, in outbox order."""
        rounds: list[list[tuple[int, OutboxRecord]]] = []
        depth: dict[str, int] = {}
        for seq, record in self.outbox.pending.items():
            uid = record.event.claim_uid if record.event is not None else ""
            n = depth.get(uid, 0)
            depth[uid] = n + 1
            if n == len(rounds):
                rounds.append([])
            rounds[n].append((seq, record))
        return [r[i : i + SEND_WINDOW] for r in rounds for i in range(0, len(r), SEND_WINDOW)]

    async def _send(self) -> bool:
        """Send what is pending, round by round (`_rounds`); False when a publish failed (retry later)."""
        if self.bus is None or not self.bus.connected:
            return True  # nothing to do while NATS is away (and no pass over a backlog per wake)
        for batch in self._rounds():
            if self.bus is None or not self.bus.connected:
                return True
            stored = await self._send_round(batch)
            if stored:
                await self.outbox.ack(stored)
            if len(stored) < len(batch):
                return False
        return True

    async def _send_round(self, batch: list[tuple[int, OutboxRecord]]) -> list[int]:
        """Publish a round's events all at once, then wait for their acks; the seqs stored. One event per
        claim in a round, so what one failure leaves unsent never reorders a claim's events."""
        in_flight: list[tuple[int, asyncio.Future[Any]]] = []
        assert self.bus is not None  # _send checks it before each round
        for seq, record in batch:
            event = record.event
            assert event is not None
            try:  # the publish continues the trace of the span that caused the event, not the sender's
                future = await self.bus.publish_nowait(
                    catalog.CLAIM,
                    event,
                    msg_id=record.msg_id,
                    traceparent=record.traceparent,
                    namespace=subject_token(event.claim_namespace),
                    node=subject_token(event.node),
                    event=event.event,
                )
            except Exception as exc:  # noqa: BLE001 - it stays in the outbox; retried
                log.info("lifecycle event not sent yet; will retry", error=str(exc) or type(exc).__name__)
                break
            in_flight.append((seq, future))
        stored: list[int] = []
        if not in_flight:
            return stored
        # one deadline for the round: acks lost with a connection (a NATS restart) never come
        _, late = await asyncio.wait([f for _, f in in_flight], timeout=ACK_TIMEOUT_S)
        for future in late:
            future.cancel()
        for seq, future in in_flight:
            error = "no ack within the round's deadline" if future.cancelled() else future.exception()
            if error is not None:  # not stored (or not known to be): resent, de-duplicated by its message id
                log.info("lifecycle event not stored yet; will retry", error=str(error) or type(error).__name__)
                continue
            self.sent += 1
            stored.append(seq)
        return stored

    async def run(self) -> None:
        """Send the outbox whenever a connected bus is attached (until cancelled)."""
        while True:
            await self._wake.wait()
            # let the rest of the burst land in the outbox (module doc): `linger` from the wake, so events that
            # came while the last round was in flight have had theirs and go out now
            await asyncio.sleep(self._woken_at + self.linger - time.monotonic())
            self._wake.clear()
            ok = await self._send()
            if not self.outbox.pending:
                self._drained.set()
            elif not ok:
                await asyncio.sleep(0.5)
                self._woke()
            # else: the bus is away; its reconnect wakes the sender (attach)
