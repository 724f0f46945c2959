"""The Kubernetes CEL extensions DRA selectors may use, as functions for the `cel` package.

Owns `semver()`/`isSemver()` and `quantity()`/`isQuantity()` with their methods (`compareTo`,
`isGreaterThan`, `isLessThan`, `major`...; `add`, `sub`, `asInteger`, `isInteger`,
`asApproximateFloat`, `sign`), the cel-go strings extension (`lowerAscii`, `split`, `join`...), the
Kubernetes lists library (`isSorted`, `sum`, `min`, `max`, `indexOf`, `lastIndexOf`) and regex
`find`/`findAll`. The `cel` package calls a method with its receiver as the first argument.

Semvers and quantities travel through CEL as one-key maps (`{"__semver__": "1.2.3"}`,
`{"__quantity__": "num/den"}`) holding a normalised form, so `==` between two of them is exact.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache
from typing import Any

from embedded.scheduler.values import (
    QuantityError,
    Semver,
    SemverError,
    compare_semver,
    parse_quantity,
    parse_semver,
    semver_text,
)

SEMVER_KEY = "__semver__"
QUANTITY_KEY = "__quantity__"
INT64 = (-(1 << 63), (1 << 63) - 1)


class CelFunctionError(ValueError):
    """A CEL extension function was called with the wrong kind of value."""


def semver_value(v: Semver) -> dict[str, str]:
    return {SEMVER_KEY: semver_text(v)}


def quantity_value(q: Fraction) -> dict[str, str]:
    return {QUANTITY_KEY: f"{q.numerator}/{q.denominator}"}


def _as_semver(value: Any, what: str) -> Semver:
    if isinstance(value, dict) and SEMVER_KEY in value:
        return parse_semver(value[SEMVER_KEY])
    raise CelFunctionError(f"{what} needs a semver (use semver('1.2.3')), got {_kind(value)}")


@lru_cache(maxsize=4096)
def _fraction(text: str) -> Fraction:
    return Fraction(text)


def _as_quantity(value: Any, what: str) -> Fraction:
    if isinstance(value, dict) and QUANTITY_KEY in value:
        return _fraction(value[QUANTITY_KEY])
    if isinstance(value, int) and not isinstance(value, bool):
        return Fraction(value)
    raise CelFunctionError(f"{what} needs a quantity (use quantity('40Gi')), got {_kind(value)}")


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        if SEMVER_KEY in value:
            return "a semver"
        if QUANTITY_KEY in value:
            return "a quantity"
        return "a map"
    return {bool: "a bool", int: "an int", float: "a double", str: "a string", list: "a list"}.get(
        type(value), type(value).__name__
    )


def _sign(n: int) -> int:
    return (n > 0) - (n < 0)


# --- semver -------------------------------------------------------------------------------------


def semver(text: str, normalize: bool = False) -> dict[str, str]:
    try:
        return semver_value(parse_semver(text, bool(normalize)))
    except SemverError as exc:
        raise CelFunctionError(str(exc)) from None


def is_semver(text: Any, normalize: bool = False) -> bool:
    try:
        parse_semver(text, bool(normalize))
    except (SemverError, TypeError):
        return False
    return True


# --- quantity -----------------------------------------------------------------------------------


def quantity(text: str) -> dict[str, str]:
    try:
        return quantity_value(parse_quantity(text))
    except QuantityError as exc:
        raise CelFunctionError(str(exc)) from None


def is_quantity(text: Any) -> bool:
    try:
        parse_quantity(text)
    except (QuantityError, TypeError):
        return False
    return True


def compare_to(a: Any, b: Any) -> int:
    if isinstance(a, dict) and SEMVER_KEY in a:
        return compare_semver(_as_semver(a, "compareTo"), _as_semver(b, "semver compareTo"))
    qa, qb = _as_quantity(a, "compareTo"), _as_quantity(b, "quantity compareTo")
    return _sign((qa > qb) - (qa < qb))


def is_greater_than(a: Any, b: Any) -> bool:
    return compare_to(a, b) > 0


def is_less_than(a: Any, b: Any) -> bool:
    return compare_to(a, b) < 0


def q_add(a: Any, b: Any) -> dict[str, str]:
    return quantity_value(_as_quantity(a, "add") + _as_quantity(b, "add"))


def q_sub(a: Any, b: Any) -> dict[str, str]:
    return quantity_value(_as_quantity(a, "sub") - _as_quantity(b, "sub"))


def q_is_integer(a: Any) -> bool:
    q = _as_quantity(a, "isInteger")
    return q.denominator == 1 and INT64[0] <= q.numerator <= INT64[1]


def q_as_integer(a: Any) -> int:
    q = _as_quantity(a, "asInteger")
    if not q_is_integer(a):
        raise CelFunctionError(f"quantity {float(q)} is not an integer in int64 range; guard with isInteger()")
    return q.numerator


def q_as_float(a: Any) -> float:
    return float(_as_quantity(a, "asApproximateFloat"))


def q_sign(a: Any) -> int:
    return _sign(_as_quantity(a, "sign").numerator)


# --- strings (cel-go ext.Strings) ------------------------------------------------------------------


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise CelFunctionError(f"{what} needs a string, got {_kind(value)}")
    return value


def char_at(s: Any, i: int) -> str:
    text = _str(s, "charAt")
    if not 0 <= i <= len(text):
        raise CelFunctionError(f"charAt index {i} out of range for a string of length {len(text)}")
    return text[i : i + 1]


def index_of(s: Any, sub: Any, start: int = 0) -> int:
    if isinstance(s, list):
        return next((i for i, v in enumerate(s) if v == sub), -1)
    text = _str(s, "indexOf")
    if not 0 <= start <= len(text):
        raise CelFunctionError(f"indexOf start {start} out of range for a string of length {len(text)}")
    return text.find(_str(sub, "indexOf"), start)


def last_index_of(s: Any, sub: Any, end: int | None = None) -> int:
    if isinstance(s, list):
        return next((i for i in range(len(s) - 1, -1, -1) if s[i] == sub), -1)
    text = _str(s, "lastIndexOf")
    needle = _str(sub, "lastIndexOf")
    if end is None:
        return text.rfind(needle)
    return text.rfind(needle, 0, end + len(needle))


def replace(s: Any, old: Any, new: Any, n: int = -1) -> str:
    return _str(s, "replace").replace(_str(old, "replace"), _str(new, "replace"), n)


def split(s: Any, sep: Any, n: int = -1) -> list[str]:
    text, separator = _str(s, "split"), _str(sep, "split")
    if n == 0:
        return []
    if separator == "":
        chars = list(text)
        return chars if n < 0 else [*chars[: n - 1], "".join(chars[n - 1 :])]
    return text.split(separator, -1 if n < 0 else n - 1)


def substring(s: Any, start: int, end: int | None = None) -> str:
    text = _str(s, "substring")
    stop = len(text) if end is None else end
    if not 0 <= start <= stop <= len(text):
        raise CelFunctionError(f"substring({start}, {stop}) out of range for a string of length {len(text)}")
    return text[start:stop]


def join(items: Any, sep: str = "") -> str:
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise CelFunctionError("join needs a list of strings")
    return sep.join(items)


# --- lists (Kubernetes library) ----------------------------------------------------------------


def _comparable(items: Any, what: str) -> list[Any]:
    if not isinstance(items, list):
        raise CelFunctionError(f"{what} needs a list, got {_kind(items)}")
    if items and isinstance(items[0], dict):
        raise CelFunctionError(f"{what} on semvers or quantities is not supported; compare with compareTo()")
    return items


def is_sorted(items: Any) -> bool:
    values = _comparable(items, "isSorted")
    return all(a <= b for a, b in itertools.pairwise(values))


def list_sum(items: Any) -> Any:
    return sum(_comparable(items, "sum"))


def list_min(items: Any) -> Any:
    values = _comparable(items, "min")
    if not values:
        raise CelFunctionError("min of an empty list")
    return min(values)


def list_max(items: Any) -> Any:
    values = _comparable(items, "max")
    if not values:
        raise CelFunctionError("max of an empty list")
    return max(values)


def find(s: Any, pattern: str) -> str:
    m = re.search(pattern, _str(s, "find"))
    return m.group(0) if m else ""


def find_all(s: Any, pattern: str, n: int = -1) -> list[str]:
    found = [m.group(0) for m in re.finditer(pattern, _str(s, "findAll"))]
    return found if n < 0 else found[:n]


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "semver": semver,
    "isSemver": is_semver,
    "major": lambda v: _as_semver(v, "major")[0],
    "minor": lambda v: _as_semver(v, "minor")[1],
    "patch": lambda v: _as_semver(v, "patch")[2],
    "quantity": quantity,
    "isQuantity": is_quantity,
    "compareTo": compare_to,
    "isGreaterThan": is_greater_than,
    "isLessThan": is_less_than,
    "add": q_add,
    "sub": q_sub,
    "isInteger": q_is_integer,
    "asInteger": q_as_integer,
    "asApproximateFloat": q_as_float,
    "sign": q_sign,
    "charAt": char_at,
    "indexOf": index_of,
    "lastIndexOf": last_index_of,
    "lowerAscii": lambda s: "".join(c.lower() if c.isascii() else c for c in _str(s, "lowerAscii")),
    "upperAscii": lambda s: "".join(c.upper() if c.isascii() else c for c in _str(s, "upperAscii")),
    "replace": replace,
    "split": split,
    "substring": substring,
    "trim": lambda s: _str(s, "trim").strip(),
    "join": join,
    "reverse": lambda s: _str(s, "reverse")[::-1],
    "isSorted": is_sorted,
    "sum": list_sum,
    "min": list_min,
    "max": list_max,
    "find": find,
    "findAll": find_all,
}
