"""Dead letters: messages a consumer could not decode, kept with the reason for inspection."""

from __future__ import annotations

from shared.events.base import Message


class DeadLetter(Message, kw_only=True):
    """A message that failed to decode on `subject`; `payload` is its raw bytes as text (lossy)."""

    subject: str
    consumer: str
    error: str
    payload: str
    observed_at: float = 0.0
