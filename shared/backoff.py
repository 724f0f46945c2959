"""The one retry delay: exponential, capped, and back to the start after a run that lasted.

`Backoff` answers how long to wait before the next try of something that keeps failing, the way the
kubelet spaces out the restarts of a crashing container: `initial_s`, doubled each time up to
`cap_s`; a try that then ran for `stable_after_s` or longer was not part of a crash loop, so the
next delay starts from `initial_s` again.
"""

from __future__ import annotations


class Backoff:
    """`delay = backoff.next()` before each retry; `backoff.reset()` after a success (or `delay =
    backoff.restart()`); `backoff.ran(seconds)` after a try that ran a while."""

    def __init__(
        self, initial_s: float = 0.2, cap_s: float = 10.0, factor: float = 2.0, stable_after_s: float = 30.0
    ) -> None:
        if not 0 < initial_s <= cap_s or factor < 1:
            raise ValueError(f"backoff needs 0 < initial ({initial_s}) <= cap ({cap_s}) and factor ({factor}) >= 1")
        self.initial_s = initial_s
        self.cap_s = cap_s
        self.factor = factor
        self.stable_after_s = stable_after_s
        self._next = initial_s

    def next(self) -> float:
        """The delay before the next try; the one after it is longer, up to the cap."""
        delay = self._next
        self._next = min(delay * self.factor, self.cap_s)
        return delay

    def reset(self) -> None:
        self._next = self.initial_s

    def restart(self) -> float:
        """Start over: the first delay again (`initial_s`), the one after it longer."""
        self.reset()
        return self.next()

    def ran(self, seconds: float) -> None:
        """A try lasted `seconds` before it failed; a stable run resets the delay."""
        if seconds >= self.stable_after_s:
            self.reset()
