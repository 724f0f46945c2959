"""The ledger's NATS side: a durable JetStream pull consumer on the claim lifecycle stream.

Each fetched batch is checked against the published schema, accounted, written to the ledger file,
and only then acknowledged. A crash before the ack means redelivery, which the ledger recognises
by event key and ignores; a crash before the write means the batch is simply applied again.
An event whose body speaks for another namespace or node than its subject is not accounted, and
body times are bounded by the server's (trust.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from . import store, trust
from .accounting import Ledger
from .schema import Contract, SchemaViolation

log = logging.getLogger("gpu_seconds_ledger")

DEFAULT_DURABLE = "gpu-seconds-ledger"


class LedgerService:
    """Connect, consume, account, persist, ack; `await service.run()` until cancelled."""

    def __init__(
        self,
        nats_url: str,
        contract: Contract,
        state_path: Path,
        *,
        durable: str = DEFAULT_DURABLE,
        namespace: str | None = None,
        ack_wait_s: float = 30.0,
        batch: int = 256,
        fetch_timeout_s: float = 1.0,
        ack_timeout_s: float = 10.0,
        after_persist: Callable[[list[Msg]], Awaitable[None]] | None = None,
        credentials: str | None = None,
        inbox_prefix: str | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.credentials = credentials  # a .creds file (JWT + NKEY seed): the reader user the operator issued
        self.inbox_prefix = inbox_prefix  # `_INBOX_<identity>`: the only inbox a reader user may subscribe to
        self.contract = contract
        self.state_path = state_path
        self.durable = durable
        self.filter_subject = contract.scoped(namespace) if namespace else contract.filter_subject
        self.ack_wait_s = ack_wait_s
        self.batch = batch
        self.fetch_timeout_s = fetch_timeout_s
        self.ack_timeout_s = ack_timeout_s  # how long the server may take to confirm a batch's acks
        self.idle_fetches = 0  # fetches that found nothing new (the stream was idle)
        self.unconfirmed_batches = 0  # batches whose acks the server did not confirm within ack_timeout_s
        self.after_persist = after_persist  # test seam: runs between the write and the acks
        self.ledger = Ledger(contract.retention_s)
        self.nc: Client | None = None
        self._sub: Any = None
        self._progress = asyncio.Condition()

    async def start(self, stream_wait_s: float = 30.0) -> None:
        """Load the ledger file, connect, and bind the durable consumer (waiting for the stream)."""
        self.ledger = await store.load(self.state_path, self.contract.retention_s)
        login: dict[str, Any] = {}
        if self.credentials:
            login["user_credentials"] = self.credentials  # nats-py needs `nkeys` for it: nats-py[nkeys]
        if self.inbox_prefix:
            login["inbox_prefix"] = self.inbox_prefix
        self.nc = await nats.connect(self.nats_url, name=f"ledger-{self.durable}", max_reconnect_attempts=-1,
                                     **login)
        js = self.nc.jetstream()
        config = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_deliver=-1,
            filter_subject=self.filter_subject,
        )
        deadline = asyncio.get_running_loop().time() + stream_wait_s
        delay = 0.1
        while True:
            try:
                self._sub = await js.pull_subscribe(
                    self.filter_subject, durable=self.durable, stream=self.contract.stream, config=config)
                break
            except nats.js.errors.NotFoundError:
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(
                        f"stream {self.contract.stream} not found on {self.nats_url} after {stream_wait_s:.0f} s; "
                        "is the driver's NATS (with JetStream) the one given?") from None
                log.info("waiting for stream %s", self.contract.stream)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        log.info("ledger bound to %s (durable %s, filter %s)", self.contract.stream, self.durable,
                 self.filter_subject)

    async def run(self) -> None:
        """Consume until cancelled; an idle stream is waited out, not an error."""
        if self._sub is None:
            raise RuntimeError("call start() first")
        task = asyncio.current_task()
        while True:
            if task is not None and task.cancelling():
                # cancelled, but an inner wait_for (nats-py's fetch and request use it) returned its result
                # instead of raising: Python 3.11 can drop a cancellation that way
                raise asyncio.CancelledError
            try:
                msgs = await self._sub.fetch(self.batch, timeout=self.fetch_timeout_s)
            except (TimeoutError, nats.errors.TimeoutError):
                # Nothing arrived in time. nats-py raises its own TimeoutError (FetchTimeoutError) or,
                # when the deadline ran out between its two pull requests, asyncio's (the builtin).
                await self._idle()
                continue
            if msgs:
                await self.handle(msgs)

    async def _idle(self) -> None:
        self.idle_fetches += 1
        async with self._progress:
            self._progress.notify_all()

    def _first_sight(self, key: str) -> bool:
        """Note a skipped message under `key` (kept with the ledger, so a redelivery is not counted
        again); False when it was noted before."""
        if key in self.ledger.applied:
            return False
        self.ledger.note(key, self.ledger.newest)
        return True

    def _account(self, msg: Msg) -> None:
        headers = msg.headers or {}
        seq = msg.metadata.sequence.stream
        try:
            event = json.loads(msg.data)
            self.contract.check(event)
        except (json.JSONDecodeError, UnicodeDecodeError, SchemaViolation) as exc:
            if self._first_sight(f"rejected:{headers.get('Nats-Msg-Id') or seq}"):
                self.ledger.stats.rejected += 1
                log.warning("message on %s does not match the published schema, skipped: %s", msg.subject, exc)
            return
        why = trust.mismatch(self.contract.subject_pattern, self.contract.binds, msg.subject, event)
        if why:
            if self._first_sight(f"identity:{seq}"):
                self.ledger.stats.identity_mismatches += 1
                log.warning("identity-mismatch: event on %s not accounted: %s", msg.subject, why)
            return
        at, clamped = trust.bounded_time(float(event.get("observed_at", 0.0)), trust.server_time(msg.metadata))
        if clamped:
            log.warning("event on %s says observed_at=%s, out of bounds of the server's time; accounted at %s",
                        msg.subject, event.get("observed_at"), at)
            event["observed_at"] = at
        node = (trust.subject_tokens(self.contract.subject_pattern, msg.subject) or {}).get("node", "")
        if self.ledger.apply(event, trust.event_key(event, node, seq)) == "applied" and clamped:
            self.ledger.stats.clamped_times += 1

    async def handle(self, msgs: list[Msg]) -> None:
        """Account a batch, persist it, then acknowledge it."""
        for msg in msgs:
            self._account(msg)
        await store.save(self.state_path, self.ledger)
        if self.after_persist is not None:
            await self.after_persist(msgs)
        # One connection's messages are handled in order: the server's answer to the last ack confirms them all.
        for msg in msgs[:-1]:
            await msg.ack()
        try:
            await msgs[-1].ack_sync(timeout=self.ack_timeout_s)
        except nats.errors.TimeoutError:
            # NATS stalled or restarting: the acks go out once it is back, and any that are lost bring the
            # batch again after ack_wait, whose events the ledger then skips as applied already
            self.unconfirmed_batches += 1
            log.warning("acks not confirmed within %.1f s; NATS away? going on", self.ack_timeout_s)
        pending = msgs[-1].metadata.num_pending
        if pending == 0:
            log.info("caught up: %d applied, %d duplicates, %d rejected", self.ledger.stats.applied,
                     self.ledger.stats.duplicates, self.ledger.stats.rejected)
        async with self._progress:
            self._progress.notify_all()

    async def wait_until(self, predicate: Callable[[Ledger], bool], timeout: float = 10.0) -> None:
        """Until the ledger satisfies `predicate` after a batch (or already does)."""
        async with asyncio.timeout(timeout), self._progress:
            await self._progress.wait_for(lambda: predicate(self.ledger))

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
            self.nc = None
