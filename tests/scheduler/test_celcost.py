"""The estimated cost of DRA selectors: the figures upstream's compiler gives, every selector this repo
ships under the limit, the hostile one far over it, and a parser that keeps up with the `cel` package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cel
import pytest
import yaml

from embedded.scheduler.celcost import MAX_COST, estimate
from embedded.scheduler.celparse import MAX_DEPTH, CelSyntaxError, Lit, parse

REPO = Path(__file__).resolve().parents[2]
TEN = "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"

# expectCost of dynamic-resource-allocation/cel/compile_test.go (attribute values sized 64).
UPSTREAM = {
    'device.attributes["no-such-domain"].noSuchAttr.isGreaterThan(quantity("0"))': 6,
    'device.attributes["no-such-domain"]["noSuchAttr"].isGreaterThan(quantity("0"))': 6,
    '"no-such-domain" in device.attributes': 3,
    'device.driver == ""': 2,
    'device.driver == "dra.example.com"': 4,
    'device.attributes["dra.example.com"].name': 4,
    'device.attributes["dra.example.com"]["name"]': 4,
    'cel.bind(dra, device.attributes["dra.example.com"], dra.name)': 15,
    'device.attributes["dra.example.com"].name > 0': 5,
    'device.attributes["dra.example.com"].name == "fish"': 5,
    'device.attributes["dra.example.com"].name.exists(x, x > 0)': 5 + 6 * 64,
    'device.attributes["dra.example.com"].names.size() == 2': 6,
    'device.attributes["dra.example.com"].names.all(x, x != "")': 5 + 4 * 64,
    'device.attributes["dra.example.com"].names.all(x, x.isGreaterThan(semver("0.0.1")))': 5 + 6 * 64,
    '1 in device.attributes["dra.example.com"].names': 4 + 64,
    'device.attributes["dra.example.com"].name.isGreaterThan(semver("0.0.1"))': 6,
    'device.attributes["dra.example.com"].name.isGreaterThan(semver("v0.0.1", true)) && isSemver("v1.0.0", true)': 7,
    'device.attributes["dra.example.com"].name.exists(x, x.isGreaterThan(semver("0.0.1")))': 5 + 7 * 64,
    'device.capacity["dra.example.com"].name.isGreaterThan(quantity("1Ki"))': 6,
    '"name" in device.capacity["dra.example.com"] && '
    'device.capacity["dra.example.com"].name.isGreaterThan(quantity("1Ki"))': 10,
    '!("name" in device.capacity["dra.example.com"]) || '
    'device.capacity["dra.example.com"].name.isGreaterThan(quantity("1Ki"))': 11,
    'device.attributes["dra.example.com"].a && device.attributes["dra.example.com"].b && '
    'device.attributes["dra.example.com"].c': 12,
    'device.attributes.exists_one(x, x == "dra.example.com")': 164,
    'device.attributes["dra.example.com"].exists_one(x, x == "services")': 133,
    'device.attributes["dra.example.com"].services.split("example").size() >= 2': 19,
    'device.attributes["dra.example.com"].services.matches("[^a]?sym")': 18,
    'device.capacity.exists_one(x, x == "dra.example.com")': 164,
    'device.capacity["dra.example.com"].exists_one(x, x == "memory")': 133,
    "device.allowMultipleAllocations == true": 3,
    "true": 0,
    # Seven nested 10-element all() loops: 85,555,551, over the limit (upstream's "expensive" case).
    f"{TEN}.all(x, {TEN}.all(y, {TEN}.all(z, {TEN}.all(z2, {TEN}.all(z3, {TEN}.all(z4, {TEN}.all(z5, "
    "int('1'.find('[0-9]*')) < 100)))))))": 85_555_551,
}


@pytest.mark.parametrize(("expression", "cost"), UPSTREAM.items(), ids=range(len(UPSTREAM)))
def test_estimates_match_upstream(expression: str, cost: int) -> None:
    assert estimate(expression).cost == cost


def test_the_hostile_selector_is_far_over_the_limit() -> None:
    items = "[" + ",".join(str(i) for i in range(1, 501)) + "]"
    hostile = (
        f"{items}.all(x, {items}.all(y, {items}.all(z, "
        'device.attributes["gpu.nvidia.com"].productName.matches("^(a+)+$"))))'
    )
    assert estimate(hostile).cost > 2_000 * MAX_COST
    # One 500-element loop of the same predicate is fine: sizes come from the literal.
    assert estimate(f'{items}.all(x, device.attributes["gpu.nvidia.com"].productName.matches("^a+$"))').cost < 10_000
    # Sizes flow through function results (an attribute's 64 characters split into at most 64 parts)...
    assert (
        estimate("device.attributes['d'].name.split(device.driver).map(x, x).all(y, y.split('').all(z, true))").cost
        <= MAX_COST
    )
    # ...and a loop over something of unknown size costs the maximum.
    assert estimate("string(device.attributes['d'].name).split('').all(x, true)").exceeds


def _shipped(obj: Any, out: set[str]) -> None:
    if isinstance(obj, dict):
        expression = (obj.get("cel") or {}).get("expression") if isinstance(obj.get("cel"), dict) else None
        if isinstance(expression, str):
            out.add(expression)
        for value in obj.values():
            _shipped(value, out)
    elif isinstance(obj, list):
        for value in obj:
            _shipped(value, out)


def test_every_selector_this_repo_ships_is_accepted() -> None:
    found: set[str] = set()
    for folder in ("examples", "deploy", "tests/fixtures", "docs"):
        for path in (REPO / folder).rglob("*.y*ml"):
            for doc in yaml.safe_load_all(path.read_text()):
                _shipped(doc, found)
    assert len(found) >= 6, found
    for expression in found:
        assert estimate(expression).cost <= 100, expression


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        (r"'caf\u00e9'", "string", "café"),
        (r'"a\x41\101\n"', "string", "aAA\n"),
        (r"r'\d+'", "string", r"\d+"),
        ("'''multi\nline'''", "string", "multi\nline"),
        (r"b'\xff'", "bytes", "\xff"),
        ("0x1F", "int", 31),
        ("7u", "uint", 7),
        ("-2", "int", -2),
        (".5e1", "double", 5.0),
    ],
)
def test_literals(text: str, kind: str, value: Any) -> None:
    node = parse(text)
    assert isinstance(node, Lit) and (node.kind, node.value) == (kind, value)
    cel.compile(text)  # the `cel` package agrees it is CEL


def test_long_chains_do_not_recurse() -> None:
    ors = " || ".join(f"device.attributes['gpu.nvidia.com'].index == {i}" for i in range(200))
    ternaries = " : ".join(f"device.driver == 'd{i}' ? {i}" for i in range(400)) + " : -1"
    selects = "device" + ".a" * 3000
    for text in (ors, f"({ternaries}) > 0", f"has({selects})", "1" + " + 1" * 3000):
        assert estimate(text).cost < MAX_COST


def test_nesting_and_syntax_errors() -> None:
    with pytest.raises(CelSyntaxError, match="nested deeper"):
        parse("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1))
    for bad in ("device.", "1 +", "'open", "[1, 2", "a ? b", "x.in", "'\\q'"):
        with pytest.raises(CelSyntaxError):
            parse(bad)
