"""Keeping a service's long-lived objects out of the cyclic garbage collector's full passes.

A service that caches a fleet (the publisher: every node's inventory and slices) holds hundreds of
thousands of objects that live for minutes. CPython's oldest-generation pass walks all of them
every time enough new objects survive, which at 1,000 nodes is a 100-250 ms stop of the event loop
every few seconds under load, and it finds nothing to free. `settle()` runs one full collection and
then freezes what survived (`gc.freeze`): later passes skip it. Frozen objects are still freed by
reference counting; only a cycle among them would wait for the next `settle()`, which unfreezes
first. Call it after a bulk load (start, periodic resync), not on a hot path. `collection_paused()` keeps
automatic passes out of one synchronous, allocation-heavy pass.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

from shared.logs import get_logger

log = get_logger(__name__)


def settle() -> float:
    """Full collection, then freeze the survivors; the seconds it took (the loop is held meanwhile)."""
    start = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    took = time.perf_counter() - start
    log.debug("heap settled", frozen=gc.get_freeze_count(), seconds=round(took, 3))
    return took


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic collection inside the block: for a synchronous pass that makes many short-lived,
    acyclic objects over a large heap (the scheduler's pass over every node), where each automatic
    oldest-generation pass walks the whole heap to free nothing. Reference counting still frees;
    what the block leaves in cycles is collected by the next automatic pass after it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
