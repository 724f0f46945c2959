"""Per-key locks (shared/keyedlocks.py): one holder per key, and an entry only while someone holds or waits."""

from __future__ import annotations

import asyncio

import pytest

from shared.keyedlocks import KeyedLocks


class User:
    """A task that holds `key` until its gate opens; `entered` once it holds it."""

    def __init__(self, locks: KeyedLocks[str], key: str = "claim") -> None:
        self.gate, self.entered = asyncio.Event(), asyncio.Event()
        self.task = asyncio.create_task(self._run(locks, key))

    async def _run(self, locks: KeyedLocks[str], key: str) -> None:
        async with locks.hold(key):
            self.entered.set()
            await self.gate.wait()


async def settle() -> None:
    for _ in range(5):  # what is runnable runs
        await asyncio.sleep(0)


async def test_a_caller_arriving_as_the_holder_leaves_waits_behind_the_waiter_it_finds() -> None:
    locks: KeyedLocks[str] = KeyedLocks()
    a = User(locks)
    await a.entered.wait()
    b = User(locks)
    await settle()
    assert not b.entered.is_set() and locks.locked("claim") and len(locks) == 1
    a.gate.set()
    await a.task  # a has left; b holds the key now
    c = User(locks)  # comes right after a left, while b holds it
    await settle()
    assert b.entered.is_set() and not c.entered.is_set(), "one holder at a time"
    b.gate.set()
    await c.entered.wait()
    c.gate.set()
    await asyncio.gather(b.task, c.task)
    assert len(locks) == 0 and not locks.locked("claim"), "nobody holds or waits: the entry is gone"


async def test_a_cancelled_waiter_leaves_no_entry_and_other_keys_do_not_wait() -> None:
    locks: KeyedLocks[str] = KeyedLocks()
    a = User(locks)
    await a.entered.wait()
    other = User(locks, key="other-claim")
    await other.entered.wait()  # another key is not held up
    waiter = User(locks)
    await settle()
    waiter.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter.task
    a.gate.set()
    other.gate.set()
    await asyncio.gather(a.task, other.task)
    assert len(locks) == 0
