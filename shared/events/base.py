"""Base type for every message on the bus: versioned, JSON-encoded msgspec Structs.

Events tolerate unknown fields (a newer producer may add optional fields within a subject
version); a field that changes meaning gets a new subject version (`dra.v2....`).
"""

from __future__ import annotations

import time

import msgspec


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A message on the bus. Subclasses are bound to subjects in `shared.events.catalog`."""


def now_unix() -> float:
    """Wall-clock time in seconds, the timestamp every event carries."""
    return time.time()
