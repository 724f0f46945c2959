"""Query parameters read as the Go API server decodes them into its options: booleans as strconv.ParseBool
reads them, integers as strconv.ParseInt does (base 10, ASCII digits after an optional sign, int64). A value
that is not an integer is a 400 naming the parameter, before the request does anything."""

from __future__ import annotations

from collections.abc import Mapping

from embedded.apiserver import errors
from shared.numbers import decimal_int

_INT64 = 1 << 63


def truthy(value: str | None) -> bool:
    """Go's strconv.ParseBool truths, which query parameters use (clients send true, True or 1)."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def query_int(query: Mapping[str, str], name: str) -> int | None:
    """The integer parameter `name` (None when absent or empty); a 400 when it is not a base-10 int64."""
    raw = query.get(name)
    if not raw:
        return None
    value = decimal_int(raw, signed=True)
    if value is None or not -_INT64 <= value < _INT64:
        raise errors.bad_request(f"invalid value {raw!r} for query parameter {name}: it must be an integer")
    return value
