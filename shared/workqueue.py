"""The one work queue of the controllers (the publisher's nodes, the local cluster's objects), as client-go's.

A key is queued once however often it is added; a key being worked on that is added again is handed out
once it is `done`. `add(key, cause)` keeps the trace contexts that asked for the work; `get` hands them out
with the key. `retry(key)` queues a failed key after its own backoff (50 ms doubling to 30 s); drop it from
`backoffs` after a success.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

from opentelemetry import context as otel_context

from shared.backoff import Backoff

K = TypeVar("K")


class WorkQueue(Generic[K]):
    def __init__(self) -> None:
        self._order: deque[K] = deque()
        self._pending: dict[K, list[otel_context.Context]] = {}  # queued or added while busy: their causes
        self._busy: set[K] = set()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._timers: set[asyncio.TimerHandle] = set()
        self.backoffs: dict[K, Backoff] = {}  # keys that failed, until they next succeed

    def __len__(self) -> int:
        """Keys waiting or being worked on."""
        return len(self._pending.keys() | self._busy)

    def add(self, key: K, cause: otel_context.Context | None = None) -> None:
        causes = self._pending.get(key)
        if causes is None:
            self._pending[key] = causes = []
            if key not in self._busy:
                self._order.append(key)
                self._ready.set()
        if cause is not None:
            causes.append(cause)
        self._idle.clear()

    def add_after(self, key: K, delay: float) -> None:
        def fire() -> None:
            self._timers.discard(handle)
            self.add(key)

        handle = asyncio.get_running_loop().call_later(max(0.0, delay), fire)
        self._timers.add(handle)

    def retry(self, key: K) -> float:
        """Queue a failed key again after its backoff; the delay."""
        delay = self.backoffs.setdefault(key, Backoff(initial_s=0.05, cap_s=30.0)).next()
        self.add_after(key, delay)
        return delay

    async def get(self) -> tuple[K, list[otel_context.Context]]:
        while not self._order:
            self._ready.clear()
            await self._ready.wait()
        key = self._order.popleft()
        self._busy.add(key)
        return key, self._pending.pop(key)

    def done(self, key: K) -> None:
        self._busy.discard(key)
        if key in self._pending:
            self._order.append(key)
            self._ready.set()
        elif not self._pending and not self._busy:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no key is waiting or being worked on."""
        await self._idle.wait()

    def close(self) -> None:
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
