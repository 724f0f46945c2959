"""Keeping a service's long-lived objects out of the cyclic garbage collector's full passes.

A service that caches a fleet (the publisher: every node's inventory and slices) holds hundreds of
thousands of objects that live for minutes. CPython's oldest-generation pass walks all of them
every time enough new objects survive, which at 1,000 nodes is a 100-250 ms stop of the event loop
every few seconds under load, and it finds nothing to free. `settle()` runs one full collection and
then freezes what survived (`gc.freeze`): later passes skip it. Frozen objects are still freed by
reference counting; only a cycle among them would wait for the next `settle()`, which unfreezes
first. Call it after a bulk load (start, periodic resync), not on a hot path.
"""

from __future__ import annotations

import gc
import time

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
