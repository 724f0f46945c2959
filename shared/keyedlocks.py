"""One asyncio lock per key (a claim's uid), kept only while someone holds it or waits for it.

A lock dropped from a plain dict while a waiter still waits on it lets the next caller make a second lock for the
same key and run beside that waiter; here each entry counts its holder and waiters and goes with the last of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
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

    def hold(self, key: K) -> _Hold[K]:
        return _Hold(self._entries, key)

    def locked(self, key: K) -> bool:
        """Whether someone holds `key` now."""
        entry = self._entries.get(key)
        return entry is not None and entry.lock.locked()

    def __len__(self) -> int:
        """Keys held or waited for."""
        return len(self._entries)


class _Hold(Generic[K]):
    __slots__ = ("_entries", "_entry", "_key")

    def __init__(self, entries: dict[K, _Entry], key: K) -> None:
        self._entries, self._key = entries, key

    async def __aenter__(self) -> None:
        entry = self._entries.get(self._key)
        if entry is None:
            entry = self._entries[self._key] = _Entry()
        entry.users += 1
        self._entry = entry
        try:
            await entry.lock.acquire()
        except BaseException:  # cancelled while waiting: no longer a user
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._entry.lock.release()
        self._leave()

    def _leave(self) -> None:
        self._entry.users -= 1
        if not self._entry.users:
            del self._entries[self._key]
