"""Per-node shares of the shared streams: a token bucket of bytes per node, refilled at a steady rate.

Each gate replica keeps its own buckets; with R replicas in one queue group a node gets at most R times
its share, still a bounded fraction of a stream that holds every node's events."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Share:
    """`rate` bytes per second after a `burst` of bytes; `clock` seconds (monotonic)."""

    rate: float
    burst: float
    clock: Callable[[], float] = time.monotonic
    _level: dict[str, tuple[float, float]] = field(default_factory=dict)  # node: (bytes left, at)

    MAX_NODES = 200_000  # bounded: a full bucket is forgotten (it holds nothing) when this many are kept

    def take(self, node: str, size: int) -> bool:
        """Whether `node` may store `size` more bytes now (taken from its share when it may)."""
        now = self.clock()
        left, at = self._level.get(node, (self.burst, now))
        left = min(self.burst, left + (now - at) * self.rate)
        if size > left:
            self._level[node] = (left, now)
            return False
        if len(self._level) >= self.MAX_NODES:
            self._level = {n: v for n, v in self._level.items() if v[0] < self.burst}
        self._level[node] = (left - size, now)
        return True
