"""The ledger itself: per-namespace GPU-seconds from claim lifecycle events, idempotent under replay.

A claim's use on a node opens at `prepared` and closes at `unprepared` (or `rolled-back`); its cost
is (close - open) by the producer's `observed_at` (bounded by the server's timestamp, trust.py)
times the devices it got, so replaying the same events always gives the same totals. Full GPUs add to `gpu_seconds`; MIG devices add to
`mig_seconds[<profile>]` (a biller prices each profile). A share of a GPU (a device with a `share_id`)
adds its fraction of the GPU (`share_fraction`) times the seconds to `gpu_share_seconds`; a share of a
MIG device adds its fraction to that profile's `mig_seconds` (the rule: shared/billing.py). Every state-changing event is remembered
by its key (event id under its subject's node, else stream sequence: trust.event_key) for as long
as the stream can replay it, so a redelivered or replayed event changes nothing.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# the billing rule is the driver's own, shared with the fleet page's GPU-hours (standard library only)
from shared.billing import billed_as, mig_profile, share_fraction

__all__ = ["Ledger", "LedgerFileError", "mig_profile", "share_fraction"]

FORMAT_VERSION = 1
OPENS = {"prepared"}
CLOSES = {"unprepared", "rolled-back"}

Outcome = Literal["applied", "duplicate", "ignored"]


class LedgerFileError(ValueError):
    """A ledger file that cannot be read back; the text says which and why."""


@dataclass
class OpenUse:
    """A claim prepared on a node and not yet unprepared."""

    namespace: str
    claim: str
    node: str
    started_at: float
    devices: list[str]
    # per device (same order): its fraction for a share of the device, None for all of it; empty: all whole
    fractions: list[float | None] = field(default_factory=list)

    def held(self) -> list[tuple[str, float | None]]:
        """Each device with its share fraction (None: the whole device)."""
        return [(d, self.fractions[i] if i < len(self.fractions) else None) for i, d in enumerate(self.devices)]


@dataclass
class NamespaceTotals:
    gpu_seconds: float = 0.0
    mig_seconds: dict[str, float] = field(default_factory=dict)
    claims_closed: int = 0
    gpu_share_seconds: float = 0.0  # shares of GPUs: seconds x each share's fraction of its GPU


@dataclass
class Stats:
    applied: int = 0
    duplicates: int = 0
    ignored: int = 0
    rejected: int = 0
    unmatched_closes: int = 0
    identity_mismatches: int = 0  # body named another namespace/node/id than its subject: not accounted
    clamped_times: int = 0  # body time out of bounds of the server's timestamp: replaced by the bound


class Ledger:
    def __init__(self, retention_s: float = 7 * 24 * 3600) -> None:
        self.retention_s = retention_s
        self.namespaces: dict[str, NamespaceTotals] = {}
        self.open: dict[str, OpenUse] = {}
        self.applied: dict[str, float] = {}  # dedupe key -> observed_at (`note`)
        self._oldest: list[tuple[float, str]] = []  # heap of (observed_at, key) of `applied`: what to forget first
        self.stats = Stats()
        self.newest = 0.0

    def apply(self, event: dict[str, Any], key: str) -> Outcome:
        """Account one schema-checked ClaimLifecycle event."""
        kind = event["event"]
        if kind not in OPENS and kind not in CLOSES:
            self.stats.ignored += 1
            return "ignored"
        if key in self.applied:
            self.stats.duplicates += 1
            return "duplicate"
        at = float(event.get("observed_at", 0.0))
        self.note(key, at)
        self.newest = max(self.newest, at)
        use_key = f"{event['claim_uid']}@{event['node']}"
        if kind in OPENS:
            if use_key not in self.open:  # a re-prepare of an open use keeps its original start
                devices = event.get("devices", [])
                self.open[use_key] = OpenUse(
                    event["claim_namespace"], event["claim_name"], event["node"], at,
                    [d["device"] for d in devices], [share_fraction(d) for d in devices])
        else:
            use = self.open.pop(use_key, None)
            if use is None:
                self.stats.unmatched_closes += 1
            else:
                self._charge(use, max(0.0, at - use.started_at))
        self.stats.applied += 1
        self._prune()
        return "applied"

    def _charge(self, use: OpenUse, seconds: float) -> None:
        totals = self.namespaces.setdefault(use.namespace, NamespaceTotals())
        for device, fraction in use.held():
            kind, profile, weight = billed_as(device, fraction)
            if kind == "mig":
                totals.mig_seconds[profile] = totals.mig_seconds.get(profile, 0.0) + seconds * weight
            elif kind == "share":
                totals.gpu_share_seconds += seconds * weight
            else:
                totals.gpu_seconds += seconds * weight
        totals.claims_closed += 1

    def note(self, key: str, at: float) -> None:
        """Remember `key` (an event seen at `at`) so that a redelivery of it is not counted again."""
        self.applied[key] = at
        heapq.heappush(self._oldest, (at, key))

    def _prune(self) -> None:
        """Forget keys of events the stream no longer holds (they cannot be replayed): the oldest first, without
        a pass over every key per event."""
        horizon = self.newest - self.retention_s
        while self._oldest and self._oldest[0][0] < horizon:
            at, key = heapq.heappop(self._oldest)
            if self.applied.get(key) == at:
                del self.applied[key]

    def report(self, now: float | None = None) -> dict[str, Any]:
        """Totals per namespace; with `now`, open uses are counted up to it as `running_gpu_seconds`."""
        out: dict[str, Any] = {}
        for namespace in sorted({*self.namespaces, *(u.namespace for u in self.open.values())}):
            totals = self.namespaces.get(namespace, NamespaceTotals())
            entry: dict[str, Any] = {"gpu_seconds": totals.gpu_seconds, "mig_seconds": dict(totals.mig_seconds),
                                     "gpu_share_seconds": totals.gpu_share_seconds,
                                     "claims_closed": totals.claims_closed,
                                     "claims_open": sum(1 for u in self.open.values() if u.namespace == namespace)}
            if now is not None:
                mine = [u for u in self.open.values() if u.namespace == namespace]
                entry["running_gpu_seconds"] = sum(
                    max(0.0, now - u.started_at) * sum(1 for d, f in u.held() if mig_profile(d) is None and f is None)
                    for u in mine)
                entry["running_gpu_share_seconds"] = sum(
                    max(0.0, now - u.started_at) * sum(f for d, f in u.held() if mig_profile(d) is None and f is not None)
                    for u in mine)
            out[namespace] = entry
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "namespaces": {ns: asdict(t) for ns, t in sorted(self.namespaces.items())},
            "open": {k: asdict(u) for k, u in sorted(self.open.items())},
            "applied": self.applied,
            "stats": asdict(self.stats),
            "newest": self.newest,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], retention_s: float, where: str = "ledger") -> Ledger:
        if data.get("version") != FORMAT_VERSION:
            raise LedgerFileError(f"{where}: format version {data.get('version')!r}, expected {FORMAT_VERSION}; "
                                  "move it aside to rebuild the ledger from the stream")
        ledger = cls(retention_s)
        try:
            ledger.namespaces = {ns: NamespaceTotals(**t) for ns, t in data["namespaces"].items()}
            ledger.open = {k: OpenUse(**u) for k, u in data["open"].items()}
            for key, at in data["applied"].items():
                ledger.note(str(key), float(at))
            ledger.stats = Stats(**data["stats"])
            ledger.newest = float(data["newest"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LedgerFileError(f"{where}: malformed ledger ({type(exc).__name__}: {exc}); "
                                  "move it aside to rebuild the ledger from the stream") from None
        return ledger
