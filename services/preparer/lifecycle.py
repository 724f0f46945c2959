"""Claim lifecycle events (`dra.v1.claim.<ns>.<node>.<event>`), buffered while the bus is away.

Owns the bounded in-memory queue and its sender: prepare never waits on NATS; events are sent in
order once a bus is connected. Each event's id names this node (`claim_event_id`: no other node
can mint one that collides with it), and its `Nats-Msg-Id` is that id plus a random suffix drawn
once per process: a resend after a lost ack is de-duplicated by JetStream, and nobody can send a
message id ahead of ours to make the stream drop our event as a duplicate.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from typing import Any

from shared.events import catalog
from shared.events.base import now_unix
from shared.events.catalog import as_token
from shared.events.claims import ClaimEventKind, ClaimLifecycle, PreparedDeviceRef, claim_event_id
from shared.logs import get_logger

log = get_logger(__name__)


def subject_token(value: str) -> str:
    """A namespace or node made safe as one subject token."""
    return as_token(value)


class LifecycleEvents:
    """Queue events now, publish them when a bus is there."""

    def __init__(self, node: str, driver: str, max_buffered: int = 10000) -> None:
        self.node = node
        self.driver = driver
        self.pending: collections.deque[ClaimLifecycle] = collections.deque(maxlen=max_buffered)
        self._msg_id_suffix = secrets.token_hex(8)  # unguessable by other publishers (module docstring)
        self.sent = 0
        self.dropped = 0
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self.bus: Any = None

    def emit(self, event: ClaimEventKind, *, uid: str, namespace: str, name: str, generation: int,
             devices: list[PreparedDeviceRef] | None = None, error: str = "") -> None:
        if len(self.pending) == self.pending.maxlen:
            self.dropped += 1
            log.warning("lifecycle buffer full; oldest event dropped", buffered=len(self.pending))
        event_id = claim_event_id(subject_token(self.node), uid, event, generation)
        self.pending.append(ClaimLifecycle(
            event=event, node=self.node, driver=self.driver, claim_uid=uid, claim_namespace=namespace,
            claim_name=name, devices=devices or [], error=error, event_id=event_id,
            observed_at=now_unix()))
        self._drained.clear()
        self._wake.set()

    def attach(self, bus: Any) -> None:
        self.bus = bus
        self._wake.set()

    async def drained(self) -> None:
        """Until every queued event has been sent."""
        await self._drained.wait()

    async def run(self) -> None:
        """Send queued events whenever a connected bus is attached (until cancelled)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending and self.bus is not None and self.bus.connected:
                event = self.pending[0]
                try:
                    await self.bus.publish(catalog.CLAIM, event, msg_id=f"{event.event_id}/{self._msg_id_suffix}",
                                           namespace=subject_token(event.claim_namespace),
                                           node=subject_token(event.node), event=event.event)
                except Exception as exc:  # noqa: BLE001 - keep it queued and retry
                    log.info("lifecycle event not sent yet; will retry", error=str(exc) or type(exc).__name__)
                    await asyncio.sleep(0.5)
                    self._wake.set()
                    break
                self.pending.popleft()
                self.sent += 1
            if not self.pending:
                self._drained.set()
            elif self.bus is not None and not self._wake.is_set():
                await asyncio.sleep(0.25)  # bus attached but disconnected: poll for its return
                self._wake.set()
