"""Dead letters: messages a consumer refused (undecodable, or naming another identity than their
subject or key), kept with the reason for inspection."""

from __future__ import annotations

from typing import Annotated

from shared.events.base import OBSERVED_AT, Message, doc


class DeadLetter(Message, kw_only=True):
    """A message refused on `subject` (a KV value: `$KV.<bucket>.<key>`); `payload` is its raw bytes
    as text (lossy). `reason`: `undecodable` or `identity-mismatch` ("" from older producers)."""

    subject: Annotated[str, doc("The subject the refused message came on ($KV.<bucket>.<key> for a KV value).")]
    consumer: Annotated[str, doc("The consumer that refused it.")]
    error: Annotated[str, doc("Why it was refused, for people.")]
    payload: Annotated[str, doc("The refused message's bytes as text (lossy, bounded).")]
    observed_at: Annotated[float, OBSERVED_AT] = 0.0
    reason: Annotated[str, doc("undecodable or identity-mismatch ('' from older producers).")] = ""
