"""Integers written as text, read the way Go's strconv.Atoi reads them: ASCII digits 0-9, an optional sign
where asked for, nothing else. Python's int() also takes `_`, surrounding spaces and other scripts' digits
("١٢" is 12), and str.isdigit() passes superscripts ("²") that int() then refuses: text from outside the
process (a request, a claim's config, an object's field, a command line) is read here instead."""

from __future__ import annotations

import re

_UNSIGNED = re.compile(r"[0-9]+")
_SIGNED = re.compile(r"[+-]?[0-9]+")


def decimal_int(text: str, *, signed: bool = False) -> int | None:
    """`text` as a base-10 integer, or None when it is not one (a sign only when `signed`)."""
    if (_SIGNED if signed else _UNSIGNED).fullmatch(text) is None:
        return None
    return int(text)
