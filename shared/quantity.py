"""Kubernetes resource quantities (`resource.Quantity`): the one parser of the project, bounded.

Owns the grammar of k8s.io/apimachinery `resource.Quantity` (a signed number with an optional
fraction, then a binarySI suffix `Ki`..`Ei`, a decimalSI suffix `n u m k M G T P E`, or a decimal
exponent `e<int>`/`E<int>`) and its limits, checked before any arithmetic: the text is at most
`MAX_LENGTH` characters, the exponent within `MAX_EXPONENT` either way, and the value within
`MAX_VALUE` (2^63-1, the largest quantity upstream stores) in magnitude. Values are exact
`Fraction`s computed with integer math, so `1e999999` is refused in microseconds instead of
being expanded. Callers that want bytes use `parse_bytes`.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

MAX_LENGTH = 64
MAX_EXPONENT = 64
MAX_VALUE = (1 << 63) - 1

_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<number>\d+(?:\.\d*)?|\.\d+)"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE](?P<exp>[+-]?\d+))?",
    re.ASCII,  # digits 0-9 only, as Go's parser: Python's \d takes every script's digits
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_FORMS = "a number with an optional suffix (Ki Mi Gi Ti Pi Ei, n u m k M G T P E) or exponent, e.g. 40Gi, 500m, 1e3"


class QuantityError(ValueError):
    """Not a Kubernetes quantity, or one outside the limits; the message says which and what to use."""


def _shown(text: str) -> str:
    """The input as an error shows it: quoted, and cut short where its escaped form would run long
    (a control or astral character is shown as an escape up to 10 characters wide)."""
    shown = repr(text)
    return shown if len(shown) <= MAX_LENGTH + 2 else f"{text[:20]!r}... ({len(text)} characters)"


def parse_quantity(text: str) -> Fraction:
    """`40Gi` -> 42949672960, `100m` -> 1/10, exactly; QuantityError for bad syntax or a value past a limit."""
    if not isinstance(text, str):
        raise QuantityError(f"a quantity must be a string like 40Gi, got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise QuantityError(f"quantity {_shown(text)} is too long: at most {MAX_LENGTH} characters")
    return _parse(text)


@lru_cache(maxsize=4096)
def _parse(text: str) -> Fraction:
    m = _QUANTITY.fullmatch(text)
    if m is None:
        raise QuantityError(f"{_shown(text)} is not a quantity: use {_FORMS}")
    whole, _, fraction = m.group("number").partition(".")
    scale = -len(fraction)  # value = digits * 10**scale * 2**binary
    binary = 0
    suffix = m.group("suffix") or ""
    if m.group("exp") is not None:
        exponent = int(m.group("exp"))  # at most MAX_LENGTH digits: cheap
        if abs(exponent) > MAX_EXPONENT:
            raise QuantityError(
                f"quantity {_shown(text)}: exponent {exponent} is out of range -{MAX_EXPONENT}..{MAX_EXPONENT}"
            )
        scale += exponent
    elif suffix in _BINARY:
        binary = _BINARY[suffix]
    else:
        scale += _DECIMAL[suffix]
    digits = int(whole + fraction or "0")
    value = Fraction((digits * 10 ** max(scale, 0)) << binary, 10 ** max(-scale, 0))
    if value > MAX_VALUE:
        raise QuantityError(f"quantity {_shown(text)} is too large: at most {MAX_VALUE} (2^63-1)")
    return -value if m.group("sign") == "-" else value


def parse_bytes(text: str, *, what: str = "quantity", maximum: int = MAX_VALUE) -> int:
    """A whole, non-negative quantity of bytes (fractions round down) no larger than `maximum`."""
    value = parse_quantity(text)
    if value < 0:
        raise QuantityError(f"{what} {_shown(text)} must not be negative")
    if value > maximum:
        raise QuantityError(f"{what} {_shown(text)} is {int(value)} bytes, more than the {maximum} allowed")
    return int(value)
