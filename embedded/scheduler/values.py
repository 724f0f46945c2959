"""Kubernetes quantities and semantic versions as exact values, for CEL and for counter arithmetic.

Owns semver parsing (strict semver 2.0.0), comparison, and formatting quantities back to text.
Quantities are parsed by `shared.quantity` (bounded, exact `Fraction`s so that sums of counters
never round); its names are re-exported here for the scheduler's modules.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

from shared.numbers import decimal_int
from shared.quantity import QuantityError, parse_quantity

__all__ = [
    "QuantityError",
    "parse_quantity",
    "format_quantity",
    "Semver",
    "SemverError",
    "parse_semver",
    "compare_semver",
    "semver_text",
]

_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?\Z",
    re.ASCII,
)


class SemverError(ValueError):
    """Not a strict semantic version."""


def format_quantity(value: Fraction) -> str:
    """An exact value back to a short quantity string (`42949672960` -> `40Gi`)."""
    if value.denominator != 1:
        for suffix, exp in (("m", -3), ("u", -6), ("n", -9)):
            scaled = value * 10**-exp
            if scaled.denominator == 1:
                return f"{scaled.numerator}{suffix}"
        return str(float(value))
    n = value.numerator
    if n == 0:
        return "0"
    for suffix, power in (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if n % (1 << power) == 0:
            return f"{n >> power}{suffix}"
    return str(n)


class Semver(tuple[int, int, int, tuple[str, ...]]):
    """(major, minor, patch, prerelease identifiers); build metadata is ignored, as semver says."""

    __slots__ = ()


@lru_cache(maxsize=4096)
def parse_semver(text: str, normalize: bool = False) -> Semver:
    """Strict semver (`550.54.15`, `1.2.3-rc.1`); with `normalize`, `v1.2` -> 1.2.0 and leading zeros drop."""
    candidate = text if isinstance(text, str) else ""  # no trimming: Go's semver parser takes none
    if normalize:
        loose = re.match(r"^(\d+(?:\.\d+){0,2})(.*)\Z", candidate.removeprefix("v"), re.ASCII)
        if loose is not None:
            parts = [str(int(p)) for p in loose.group(1).split(".")]
            candidate = ".".join(parts + ["0"] * (3 - len(parts))) + loose.group(2)
    m = _SEMVER.match(candidate)
    if m is None:
        raise SemverError(f"{text!r} is not a semantic version: use MAJOR.MINOR.PATCH, e.g. 550.54.15")
    pre = tuple(m.group(4).split(".")) if m.group(4) else ()
    return Semver((int(m.group(1)), int(m.group(2)), int(m.group(3)), pre))


def _pre_key(pre: tuple[str, ...]) -> tuple[tuple[int, int, str], ...]:
    return tuple((1, 0, p) if (n := decimal_int(p)) is None else (0, n, "") for p in pre)


def compare_semver(a: Semver, b: Semver) -> int:
    """-1, 0 or 1 by semver precedence (a release ranks above its prereleases)."""
    if a[:3] != b[:3]:
        return -1 if a[:3] < b[:3] else 1
    if a[3] == b[3]:
        return 0
    if not a[3]:
        return 1
    if not b[3]:
        return -1
    ka, kb = _pre_key(a[3]), _pre_key(b[3])
    return -1 if ka < kb else 1


def semver_text(v: Semver) -> str:
    core = f"{v[0]}.{v[1]}.{v[2]}"
    return f"{core}-{'.'.join(v[3])}" if v[3] else core
