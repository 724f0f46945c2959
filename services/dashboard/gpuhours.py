"""Per-namespace GPU-hours over the last day, from the claim lifecycle events the dashboard sees.

A claim's use of a node opens at `prepared` and closes at `unprepared` or `rolled-back`, as in the example
ledger (examples/ledger), by the producer's `observed_at`; each device bills by the one shared rule
(shared/billing.py): a whole GPU 1 GPU-hour an hour, a share of a GPU its fraction (consumed memory over the
GPU's memory first), a MIG device 1 hour of its profile. The report counts the part of each use inside the
window (the last `WINDOW_S`), open uses up to now. The dashboard feeds it from an ordered consumer of
DRA_EVENTS that starts one window ago (services/dashboard/state.py): a restart replays the window's events
first, so the figures survive it; a use prepared before the window whose claim is still held when the
dashboard starts is not seen (its `prepared` is older than the replay). Memory is bounded: a closed use is kept
until it leaves the window, open uses are the claims prepared now. Closed uses wait in a heap by their end, so
an event drops what left the window without a pass over every use of the day.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

import msgspec

from shared.billing import billed_as, share_fraction
from shared.events.claims import ClaimLifecycle

WINDOW_S = 24 * 3600.0
OPENS = {"prepared"}
CLOSES = {"unprepared", "rolled-back"}


@dataclass
class Use:
    namespace: str
    start: float
    end: float | None = None  # None: still open
    gpu_weight: float = 0.0  # whole GPUs + shares' fractions held
    mig_weight: dict[str, float] = field(default_factory=dict)  # profile -> MIG devices (or fractions) held


class NamespaceHours(msgspec.Struct, rename="camel", kw_only=True):
    namespace: str
    gpu_hours: float = 0.0
    mig_hours: dict[str, float] = msgspec.field(default_factory=dict)
    claims_open: int = 0


class GpuHours:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.uses: dict[str, list[Use]] = {}  # "<claim uid>@<node>" -> its uses, in order (the last may be open)
        self._closed: list[tuple[float, int, str, Use]] = []  # heap of (end, tie-break, key, use)
        self._order = itertools.count()

    def apply(self, event: ClaimLifecycle) -> None:
        key = f"{event.claim_uid}@{event.node}"
        at = event.observed_at or time.time()
        if event.event in OPENS:
            uses = self.uses.setdefault(key, [])
            if uses and uses[-1].end is None:
                return  # a re-prepare of an open use keeps its start (as the ledger)
            use = Use(event.claim_namespace, at)  # prepared again after an unprepare: a use of its own
            uses.append(use)
            for device in event.devices:
                kind, profile, weight = billed_as(device.device, share_fraction(msgspec.to_builtins(device)))
                if kind == "mig":
                    use.mig_weight[profile] = use.mig_weight.get(profile, 0.0) + weight
                else:
                    use.gpu_weight += weight
        elif event.event in CLOSES:
            held = self.uses.get(key)
            if held and held[-1].end is None:  # (a close without its prepare counts nothing)
                use = held[-1]
                use.end = max(at, use.start)
                heapq.heappush(self._closed, (use.end, next(self._order), key, use))
        self._prune(at)

    def _prune(self, now: float) -> None:
        """Drop the closed uses that ended before the window ending `now` began."""
        horizon = now - self.window_s
        while self._closed and self._closed[0][0] < horizon:
            _, _, key, use = heapq.heappop(self._closed)
            uses = [u for u in self.uses[key] if u is not use]
            if uses:
                self.uses[key] = uses
            else:
                del self.uses[key]

    def report(self, now: float | None = None) -> list[NamespaceHours]:
        """Per namespace (sorted): GPU-hours and MIG-hours per profile inside the window ending `now`."""
        now = time.time() if now is None else now
        since = now - self.window_s
        out: dict[str, NamespaceHours] = {}
        for use in (u for uses in self.uses.values() for u in uses):
            hours = max(0.0, min(use.end if use.end is not None else now, now) - max(use.start, since)) / 3600
            row = out.get(use.namespace)
            if row is None:
                row = out[use.namespace] = NamespaceHours(namespace=use.namespace)
            row.claims_open += int(use.end is None)
            row.gpu_hours += hours * use.gpu_weight
            for profile, weight in use.mig_weight.items():
                row.mig_hours[profile] = row.mig_hours.get(profile, 0.0) + hours * weight
        return [out[ns] for ns in sorted(out)]
