"""Base type for every message on the bus: versioned, JSON-encoded msgspec Structs.

The contract third parties build on (docs/events.md): within a subject version (`dra.v1....`) fields
are only ever added; a removal, rename or type change comes as `dra.v2....`, published beside v1 for a
release. Every field is always on the wire, defaults included, so a consumer never has to know a
default. Consumers tolerate unknown fields (a newer producer may add some). Every field is documented
here with `doc()`: the description (and unit) lands in the exported JSON Schemas and AsyncAPI document.
"""

from __future__ import annotations

import time

import msgspec


class Message(msgspec.Struct, kw_only=True):
    """A message on the bus. Subclasses are bound to subjects in `shared.events.catalog`."""


def doc(description: str, *, unit: str = "") -> msgspec.Meta:
    """A field's description for the schemas (`Annotated[int, doc("...", unit="bytes")]`); `unit` is
    written as `x-unit` and named in the description."""
    extra = {"x-unit": unit} if unit else None
    text = f"{description} Unit: {unit}." if unit else description
    return msgspec.Meta(description=text, extra_json_schema=extra)


def now_unix() -> float:
    """Wall-clock time in seconds, the timestamp every event carries."""
    return time.time()


OBSERVED_AT = doc("When the producer observed what the message says (wall clock, Unix epoch).", unit="s")
