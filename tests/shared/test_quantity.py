"""The one quantity parser: upstream's grammar, exact values, and the limits checked before arithmetic."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from shared.quantity import MAX_VALUE, QuantityError, parse_bytes, parse_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("40Gi", 40 * 2**30),
        ("100m", Fraction(1, 10)),
        ("1.5e3", 1500),
        ("1E", 10**18),
        ("1E3", 1000),
        (".5", Fraction(1, 2)),
        ("5.", 5),
        ("-1Ki", -1024),
        ("+1k", 1000),
        ("7Ei", 7 * 2**60),
        ("9223372036854775807", MAX_VALUE),
        ("1n", Fraction(1, 10**9)),
        ("1e-64", Fraction(1, 10**64)),
    ],
)
def test_the_upstream_grammar_parses_exactly(text: str, value: Fraction | int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1e999999", "exponent 999999 is out of range -64..64"),
        ("1e-999999999999", "is out of range"),
        ("1e30", "too large: at most 9223372036854775807"),
        ("8Ei", "too large"),
        ("1e30Gi", "is not a quantity"),  # an exponent and a suffix never together
        (" 1Gi", "is not a quantity"),
        ("12 GB", "is not a quantity"),
        ("1" * 1_000_000, "(1000000 characters) is too long: at most 64 characters"),
    ],
)
def test_out_of_grammar_or_limits_is_refused_at_once(text: str, message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(QuantityError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_quantity(text)
    assert time.perf_counter() - start < 0.05


def test_bytes_are_whole_non_negative_and_bounded() -> None:
    assert parse_bytes("1.5Ki") == 1536 and parse_bytes("1500m") == 1
    with pytest.raises(QuantityError, match="must not be negative"):
        parse_bytes("-1Mi")
    with pytest.raises(QuantityError, match="is 1073741825 bytes, more than the 1073741824 allowed"):
        parse_bytes("1073741825", maximum=2**30)
