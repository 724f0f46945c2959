"""The one retry delay (shared.backoff): exponential, capped, reset by a run that lasted."""

from __future__ import annotations

import pytest

from shared.backoff import Backoff
from shared.workqueue import WorkQueue


def test_doubles_up_to_the_cap() -> None:
    backoff = Backoff(initial_s=0.2, cap_s=1.0)
    assert [backoff.next() for _ in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]


def test_a_stable_run_starts_again_from_the_initial_delay_a_short_one_does_not() -> None:
    backoff = Backoff(initial_s=0.2, cap_s=10.0, stable_after_s=30.0)
    backoff.next(), backoff.next()
    backoff.ran(29.9)
    assert backoff.next() == 0.8, "a crash loop keeps backing off"
    backoff.ran(30.0)
    assert backoff.next() == 0.2


def test_restart_draws_the_initial_delay_and_grows_from_there() -> None:
    backoff = Backoff(initial_s=0.2, cap_s=1.0)
    backoff.next(), backoff.next(), backoff.next()
    assert backoff.restart() == 0.2
    assert backoff.next() == 0.4, "the delay after a restart's is doubled, as after any other"
    backoff.reset()
    assert backoff.next() == 0.2


async def test_the_workqueue_rate_limit_is_the_backoff_of_each_key() -> None:
    """The controllers' per-key retry: 50 ms doubling to 30 s, forgotten on success (as client-go's)."""
    queue: WorkQueue[tuple[str, str, str]] = WorkQueue()
    key = ("pods", "ns", "p")
    delays = [queue.retry(key) for _ in range(12)]
    assert delays == [min(0.05 * 2**n, 30.0) for n in range(12)]
    queue.backoffs.pop(key)  # what the runner does after a reconcile succeeds
    assert queue.retry(key) == 0.05 and queue.retry(("pods", "ns", "other")) == 0.05


@pytest.mark.parametrize("initial,cap,factor", [(0, 1, 2), (2, 1, 2), (0.1, 1, 0.5)])
def test_nonsense_is_refused(initial: float, cap: float, factor: float) -> None:
    with pytest.raises(ValueError, match="backoff needs"):
        Backoff(initial_s=initial, cap_s=cap, factor=factor)
