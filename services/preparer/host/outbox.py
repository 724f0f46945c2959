"""The durable outbox of claim lifecycle events: `<plugin dir>/outbox.jsonl`, one JSON record a line.

Owns the file and what is pending in it. A record (an event, its `Nats-Msg-Id` and its outbox
sequence) is appended by the checkpoint write that the event reports (`Checkpoint.save(events=...)`
calls `write_sync` in its write step just before the checkpoint's replacement: no fsync of its own),
so an event is on file once the state change it reports is, and survives a SIGKILL of the preparer.
(Against a power loss the outbox has no fsync of its own; a reboot wipes prepared state too.) Appends
are small and unsynced, so they are made on the event loop unless a compaction holds the file.
The sender acks what JetStream stored with an `ack` line; the file is rewritten with only what is
pending (temp file, fsync, rename) once acked lines outnumber pending ones, so it stays bounded by
what is pending. A restart re-reads the file and sends what is left with the message ids it had, so
JetStream de-duplicates a resend of an event it already stored. Bounded by `max_events` and
`max_bytes`: past either, a new record is refused (`gpu_dra_outbox_dropped_total`, an error log).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from services.preparer.host import metrics
from shared.events.claims import ClaimLifecycle
from shared.files import AppendFile, atomic_write
from shared.logs import get_logger

log = get_logger(__name__)

DEFAULT_MAX_EVENTS = 100_000
DEFAULT_MAX_BYTES = 64 << 20
COMPACT_MIN_ACKS = 1024  # rewrite the file only once at least this many ack lines piled up


class OutboxRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One line of the outbox: an event to send (`add`) or the note that one was stored (`ack`)."""

    op: Literal["add", "ack"] = "add"
    seq: int  # outbox sequence (acks name it)
    msg_id: str = ""  # Nats-Msg-Id: the event id and the suffix of the process that made it
    preparation: int = 0  # the preparation the event belongs to (restores the checkpoint's sequence)
    event: ClaimLifecycle | None = None
    traceparent: str = ""  # W3C context of the span that caused the event: its publish continues that trace


_encode = msgspec.json.Encoder().encode
_decoder = msgspec.json.Decoder(OutboxRecord)


class Outbox:
    """Pending lifecycle events, mirrored to an append-only file (`path` None: memory only)."""

    def __init__(
        self,
        path: Path | None,
        *,
        driver: str,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        on_commit: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self.driver = driver
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.on_commit = on_commit
        self.pending: dict[int, OutboxRecord] = {}  # loop side: committed, not yet acked (file order)
        self.dropped = 0
        self.max_preparation = 0  # the highest preparation a loaded record names
        self._seq = 0
        self._lock = threading.Lock()  # file side, held by the writing thread
        self._in_file: dict[int, bytes] = {}  # file side: seq -> its encoded line, not yet acked
        self._bytes = 0  # size of the file
        self._pending_bytes = 0  # size of the lines not yet acked (what the bound counts)
        self._acks = 0  # ack lines in the file
        self._file = AppendFile(path) if path is not None else None  # appends through one open descriptor

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # -- the file side (worker threads; small appends also on the loop) -------------------------
    def write_sync(self, records: Sequence[OutboxRecord], *, wait: bool = True) -> list[OutboxRecord] | None:
        """Append `records` (the Journal port of the checkpoint); returns those kept (not refused). With
        `wait` False: None, having written nothing, while a compaction holds the file."""
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            kept: list[OutboxRecord] = []
            lines: list[bytes] = []
            size = self._pending_bytes
            for record in records:
                line = _encode(record) + b"\n"
                if len(self._in_file) + len(kept) >= self.max_events or size + len(line) > self.max_bytes:
                    self.dropped += 1
                    metrics.OUTBOX_DROPPED.labels(self.driver).inc()
                    log.error(
                        "lifecycle outbox full; event dropped (is NATS reachable? raise "
                        "--outbox-max-events/--outbox-max-bytes if the outage is expected)",
                        driver=self.driver,
                        pending=len(self._in_file),
                        bytes=size,
                        max_events=self.max_events,
                        max_bytes=self.max_bytes,
                        event_id=record.event.event_id if record.event else "",
                    )
                    continue
                kept.append(record)
                lines.append(line)
                size += len(line)
            if lines and self._file is not None:
                self._file.append(b"".join(lines))
            for record, line in zip(kept, lines, strict=True):
                self._in_file[record.seq] = line
            self._bytes += size - self._pending_bytes
            self._pending_bytes = size
            return kept
        finally:
            self._lock.release()

    def ack_sync(self, seqs: Sequence[int], *, wait: bool = True) -> bool:
        """Note that JetStream stored these; compact the file when acks outnumber what is pending. With
        `wait` False (on the event loop): False, having changed nothing, when that would wait for the
        file or compact it (a compaction's write is fsync'd: a worker thread's job)."""
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            if not wait and self.path is not None and self._acks + len(seqs) >= COMPACT_MIN_ACKS:
                return False
            lines = b"".join(_encode(OutboxRecord(op="ack", seq=s)) + b"\n" for s in seqs)
            for seq in seqs:
                self._pending_bytes -= len(self._in_file.pop(seq, b""))
            self._acks += len(seqs)
            if self._file is None:
                return True
            if self._acks >= COMPACT_MIN_ACKS and self._acks > len(self._in_file):
                self._rewrite()
                return True
            self._file.append(lines)
            self._bytes += len(lines)
            return True
        finally:
            self._lock.release()

    def _rewrite(self) -> None:
        assert self.path is not None
        data = b"".join(self._in_file.values())
        atomic_write(self.path, data)
        if self._file is not None:
            self._file.reopen()  # appends go to the new file
        self._bytes = len(data)
        self._acks = 0

    def load_sync(self) -> list[OutboxRecord]:
        """Read what a previous process left (a torn last line is skipped); rewrite the file compacted."""
        if self.path is None:
            return []
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        records: dict[int, OutboxRecord] = {}
        bad = 0
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                record = _decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError):
                bad += 1
                continue
            if record.op == "ack":
                records.pop(record.seq, None)
            elif record.event is not None:
                records[record.seq] = record
                self.max_preparation = max(self.max_preparation, record.preparation)
            self._seq = max(self._seq, record.seq)
        if bad:
            log.warning(
                "outbox lines not readable were skipped (a write cut short by a crash)", path=str(self.path), lines=bad
            )
        with self._lock:
            self._in_file = {seq: _encode(r) + b"\n" for seq, r in records.items()}
            self._pending_bytes = sum(len(line) for line in self._in_file.values())
            if data or records:
                self._rewrite()
            else:
                self._bytes = 0
        return list(records.values())

    # -- the loop side ------------------------------------------------------------------
    async def load(self) -> int:
        """Take over what the last process left pending; returns how many."""
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        left = await asyncio.to_thread(self.load_sync)
        for record in left:
            self.pending[record.seq] = record
        self._gauge()
        if left:
            log.info("lifecycle events left in the outbox will be sent", driver=self.driver, events=len(left))
            self._notify()
        return len(left)

    def committed(self, records: Sequence[OutboxRecord]) -> None:
        """The records are on file: send them (the Journal port of the checkpoint)."""
        for record in records:
            self.pending[record.seq] = record
        self._gauge()
        self._notify()

    async def add(self, records: Sequence[OutboxRecord]) -> None:
        """Append records that go with no checkpoint write."""
        kept = self.write_sync(records, wait=False)  # small and unsynced: bounded, on the loop
        if kept is None:
            kept = await asyncio.to_thread(self.write_sync, records)
        self.committed(kept or [])

    async def ack(self, seqs: Sequence[int]) -> None:
        for seq in seqs:
            self.pending.pop(seq, None)
        self._gauge()
        if not self.ack_sync(seqs, wait=False):  # a few lines appended: bounded, on the loop
            await asyncio.to_thread(self.ack_sync, list(seqs))

    def _gauge(self) -> None:
        metrics.OUTBOX_EVENTS.labels(self.driver).set(len(self.pending))

    def _notify(self) -> None:
        if self.on_commit is not None:
            self.on_commit()

    def size(self) -> int:
        """Bytes in the file (tests, status)."""
        return os.path.getsize(self.path) if self.path is not None and self.path.exists() else 0
