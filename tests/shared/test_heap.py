"""shared.heap.settle: survivors are frozen out of full passes; a cycle among them is freed by the next settle."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from shared.heap import settle


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_a_frozen_cycle_waits_for_the_next_settle() -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    settle()
    assert gc.get_freeze_count() > 0
    del a, b
    gc.collect()
    assert gone() is not None  # frozen: a full pass does not look at it
    settle()
    assert gone() is None
