"""Claim lifecycle events (`dra.v1.claim.<ns>.<node>.<event>`): minted here, kept in the outbox, sent when NATS is there.

Owns the making of an event (its id, its `Nats-Msg-Id`) and the sender that drains the durable
outbox (`outbox.py`) to JetStream in order: prepare never waits on NATS, and the sender lingers
`SEND_LINGER` after it is woken, so a prepare's `prepare-started` and `prepared`, and the events of
claims prepared together, go out in one round after the kubelet's call rather than interleaved with
it (one ack line written per round, not per event). Each event's id names this
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
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context

from services.preparer.outbox import DEFAULT_MAX_BYTES, DEFAULT_MAX_EVENTS, Outbox, OutboxRecord
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
from shared.telemetry import current_traceparent, traceparent_context

log = get_logger(__name__)

ACK_BATCH = 64  # sent events noted in the outbox per write
SEND_LINGER = 0.02  # seconds the sender waits after a wake, so the events of a burst go out in one round


def subject_token(value: str) -> str:
    """A namespace or node made safe as one subject token."""
    return as_token(value)


class LifecycleEvents:
    """Make events, and send what the outbox holds whenever a bus is there."""

    def __init__(self, node: str, driver: str, outbox_path: Path | None = None, *,
                 max_events: int = DEFAULT_MAX_EVENTS, max_bytes: int = DEFAULT_MAX_BYTES,
                 linger: float = SEND_LINGER) -> None:
        self.node = node
        self.linger = linger
        self.driver = driver
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self.outbox = Outbox(outbox_path, driver=driver, max_events=max_events, max_bytes=max_bytes,
                             on_commit=self._committed)
        self._msg_id_suffix = secrets.token_hex(8)  # unguessable by other publishers (module docstring)
        self.sent = 0
        self.bus: Any = None

    @property
    def pending(self) -> list[ClaimLifecycle]:
        """The events not yet stored by JetStream, oldest first."""
        return [r.event for r in self.outbox.pending.values() if r.event is not None]

    @property
    def dropped(self) -> int:
        return self.outbox.dropped

    def make(self, event: ClaimEventKind, *, uid: str, namespace: str, name: str, preparation: int,
             devices: list[PreparedDeviceRef] | None = None, error: str = "",
             reason: FailureReason = "") -> OutboxRecord:
        """An outbox record for one event; it is kept once a checkpoint write (or `outbox.add`) carries it."""
        event_id = claim_event_id(subject_token(self.node), uid, preparation, event)
        message = ClaimLifecycle(
            event=event, node=self.node, driver=self.driver, claim_uid=uid, claim_namespace=namespace,
            claim_name=name, devices=devices or [], error=error, reason=reason, event_id=event_id,
            observed_at=now_unix())
        return OutboxRecord(seq=self.outbox.next_seq(), msg_id=f"{event_id}/{self._msg_id_suffix}",
                            preparation=preparation, event=message, traceparent=current_traceparent())

    def _committed(self) -> None:
        if self.outbox.pending:
            self._drained.clear()
        self._wake.set()

    def attach(self, bus: Any) -> None:
        self.bus = bus
        self._wake.set()

    async def drained(self) -> None:
        """Until every event in the outbox has been sent."""
        await self._drained.wait()

    async def _send(self) -> bool:
        """Send what is pending, in order; False when a publish failed (retry later)."""
        acked: list[int] = []
        try:
            for seq, record in list(self.outbox.pending.items()):
                if self.bus is None or not self.bus.connected:
                    return True
                event = record.event
                assert event is not None
                # the publish continues the trace of the span that caused the event, not the sender's
                token = otel_context.attach(traceparent_context(record.traceparent))
                try:
                    await self.bus.publish(catalog.CLAIM, event, msg_id=record.msg_id,
                                           namespace=subject_token(event.claim_namespace),
                                           node=subject_token(event.node), event=event.event)
                except Exception as exc:  # noqa: BLE001 - it stays in the outbox; retried
                    log.info("lifecycle event not sent yet; will retry", error=str(exc) or type(exc).__name__)
                    return False
                finally:
                    otel_context.detach(token)
                self.sent += 1
                acked.append(seq)
                if len(acked) >= ACK_BATCH:
                    await self.outbox.ack(acked)
                    acked = []
            return True
        finally:
            if acked:
                await self.outbox.ack(acked)

    async def run(self) -> None:
        """Send the outbox whenever a connected bus is attached (until cancelled)."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.linger)  # let the rest of the burst land in the outbox (module doc)
            self._wake.clear()
            ok = await self._send()
            if not self.outbox.pending:
                self._drained.set()
            elif not ok:
                await asyncio.sleep(0.5)
                self._wake.set()
            elif self.bus is not None and not self._wake.is_set():
                await asyncio.sleep(0.25)  # bus attached but disconnected: poll for its return
                self._wake.set()
