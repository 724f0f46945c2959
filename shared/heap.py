"""Keeping a service's long-lived objects out of the cyclic garbage collector's full passes.

A service that caches a fleet (the publisher: every node's inventory and slices) holds hundreds of
thousands of objects that live for minutes. CPython's oldest-generation pass walks all of them
every time enough new objects survive, which at 1,000 nodes is a 100-250 ms stop of the event loop
every few seconds under load, and it finds nothing to free. `settle()` runs one full collection and
then freezes what survived (`gc.freeze`): later passes skip it. Frozen objects are still freed by
reference counting; only a cycle among them would wait for the next `settle()`, which unfreezes
first. Call it after a bulk load (a periodic resync), not on a hot path. `freeze_start_up()` does the
freeze alone after a process's start-up (its modules and classes, imported with collection paused).
`collection_paused()` keeps automatic passes out of one synchronous, allocation-heavy pass.
`fewer_young_collections()` lets a process with many requests in flight free their objects by reference counting
before a young pass walks them.

`release_free_memory()` hands the C heap's free pages back to the kernel (glibc's `malloc_trim`):
after a burst (64 concurrent calls, a batch's TLS connections) glibc keeps what was freed in the
middle of its heap, so RSS stays at the burst's high-water mark. `trim_periodically()` does it every
`interval` seconds for a long-running process (~0.5 ms for the preparer's ~12 MB heap). `BurstTrim` does it
as soon as a burst of requests ends (nothing left in flight after at least `after` units of work), so the
process does not sit at the burst's high-water mark until the next tick. `one_malloc_arena()` keeps every
thread's allocations in the main arena, where the trim and the next burst reuse them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import sys
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


def freeze_start_up() -> None:
    """Freeze what exists now (`gc.freeze`), at the end of a process's start-up (the `gpu-dra` command's import):
    its modules and classes live as long as the process, and every oldest-generation pass would walk them to free
    nothing. No collection first: it would cost each start-up a full pass to free a few dozen objects."""
    gc.freeze()


YOUNG_THRESHOLD = 50_000


def fewer_young_collections(threshold: int = YOUNG_THRESHOLD) -> None:
    """Run the youngest generation's pass every `threshold` allocations of tracked objects, not CPython's 700.
    With dozens of requests in flight (the publisher's 64 workers), a request's objects outlive several passes at
    700, each of which walks and promotes them, and the middle generation's passes walk them again; at 50,000
    most are freed by reference counting first. A cold publish of 10,000 nodes spent 1.3-2.4 s of its CPU in
    the collector, 0.1 s after. What it costs: objects in cycles wait up to `threshold` allocations longer."""
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(threshold, middle, oldest)


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


def _glibc(name: str) -> object:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)  # glibc; a libc without it (musl) has nothing to tune this way
    except (OSError, AttributeError):
        return None


_TRIM = _glibc("malloc_trim")
_MALLOPT = _glibc("mallopt")
_M_ARENA_MAX = -8  # glibc's malloc.h


def one_malloc_arena() -> bool:
    """Every thread allocates from glibc's main arena (`mallopt(M_ARENA_MAX, 1)`); False where the C library
    cannot (not glibc). glibc otherwise gives each thread that allocates an arena of its own (up to 8 per
    core), where what a burst freed stays apart from the main heap, partly used pages and all. For a process
    whose work is on its event loop and whose other threads are few and light (the preparer: gRPC's poller,
    timer and event-engine threads, its file writers): call it first, before any thread starts; a thread
    that allocated already keeps its arena."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_ARENA_MAX, 1))  # type: ignore[operator]


def release_free_memory() -> bool:
    """Return the C heap's free pages to the kernel; False where the C library cannot (not glibc)."""
    if _TRIM is None:
        return False
    _TRIM(0)  # type: ignore[operator]
    return True


async def trim_periodically(interval: float) -> None:
    """`release_free_memory()` every `interval` seconds until cancelled (nothing where it cannot)."""
    while release_free_memory():
        await asyncio.sleep(interval)


class BurstTrim:
    """`release_free_memory()` when the last request in flight ends and at least `after` units of work (claims)
    were done since the last trim: right after a burst, and every `after` units on a steady trickle, for a few
    tenths of a millisecond each. Wrap each request in `with trim.request(units):`; one per process (the C
    heap is the process's)."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.in_flight = 0
        self.done = 0  # units finished since the last trim
        self.trims = 0

    @contextlib.contextmanager
    def request(self, units: int = 1) -> Iterator[None]:
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self.done += units
            if self.in_flight == 0 and self.done >= self.after:
                self.done = 0
                self.trims += 1
                release_free_memory()
