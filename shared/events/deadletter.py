"""Dead letters: messages a consumer refused (undecodable, or naming another identity than their
subject or key), kept with the reason for inspection."""

from __future__ import annotations

from shared.events.base import Message


class DeadLetter(Message, kw_only=True):
    """A message refused on `subject` (a KV value: `$KV.<bucket>.<key>`); `payload` is its raw bytes
    as text (lossy). `reason`: `undecodable` or `identity-mismatch` ("" from older producers)."""

    subject: str
    consumer: str
    error: str
    payload: str
    observed_at: float = 0.0
    reason: str = ""
