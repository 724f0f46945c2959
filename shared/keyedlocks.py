"""One asyncio lock per key (a claim's or a pod's uid), kept only while someone holds it or waits for it.

A lock dropped from a plain dict while a waiter still waits on it lets the next caller make a second lock for the
same key and run beside that waiter (`Lock.locked()` is already False when the holder leaves, before the woken
waiter runs); here each entry counts its holder and waiters and goes with the last of them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class _Entry:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0  # its holder and its waiters


class KeyedLocks(Generic[K]):
    """`async with locks.hold(key):` runs alone among the holders of `key`."""

    def __init__(self) -> None:
        self._entries: dict[K, _Entry] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: K) -> AsyncIterator[None]:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        entry.users += 1
        try:
            async with entry.lock:  # a waiter cancelled here leaves through the `finally` too
                yield
        finally:
            entry.users -= 1
            if not entry.users:
                del self._entries[key]

    def locked(self, key: K) -> bool:
        """Whether someone holds `key` now."""
        entry = self._entries.get(key)
        return entry is not None and entry.lock.locked()

    def __len__(self) -> int:
        """Keys held or waited for."""
        return len(self._entries)
