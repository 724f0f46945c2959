"""The product uses its dependencies through their public APIs: no source file under shared/, services/ or
embedded/ imports a private module of a third-party package (`x._y`) or a private name from one
(generated code aside)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = {"shared", "services", "embedded", "tests", "bench"}
GENERATED = "DO NOT EDIT"  # protoc's output (services/preparer/protos) is not ours to change


def _private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def private_imports(source: str) -> list[str]:
    """The imports in `source` that reach into a third-party package's private modules or names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")]
        else:
            continue
        top = names[0].split(".")[0]
        if top not in OURS and top not in sys.stdlib_module_names:
            found += [name for name in names if _private(name)]
    return found


def test_the_scan_finds_private_modules_and_names() -> None:
    assert private_imports(
        "import nats._x\nfrom opentelemetry.sdk.trace._y import z\n"
        "from opentelemetry.trace.propagation import _SPAN_KEY\n"
        "import os._private\nfrom shared._x import y\nimport nats.js\n"
    ) == [
        "nats._x",
        "opentelemetry.sdk.trace._y",
        "opentelemetry.sdk.trace._y.z",
        "opentelemetry.trace.propagation._SPAN_KEY",
    ]


def test_no_product_source_imports_a_private_module_of_a_dependency() -> None:
    found = {
        str(path.relative_to(REPO)): names
        for top in ("shared", "services", "embedded")
        for path in sorted((REPO / top).rglob("*.py"))
        if GENERATED not in (text := path.read_text())[:300] and (names := private_imports(text))
    }
    assert found == {}


def private_attributes(source: str) -> list[str]:
    """Private attributes read or set on a name imported from a third-party package (`connector._X`,
    `getattr(aiohttp, "_y")`). An object a dependency hands back (a session, a connector) is not followed: what
    its type is takes a type checker, so a review has to catch `session._connector`."""
    tree = ast.parse(source)
    theirs: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            pairs = [(alias.name, (alias.asname or alias.name).split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            pairs = [(node.module, alias.asname or alias.name) for alias in node.names]
        else:
            continue
        theirs |= {bound for module, bound in pairs if _third_party(module)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, attr = node.value.id, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            owner, attr = node.args[0].id, node.args[1].value
        else:
            continue
        if owner in theirs and attr.startswith("_") and not attr.startswith("__"):
            found.append(f"{owner}.{attr}")
    return found


def _third_party(module: str) -> bool:
    top = module.split(".")[0]
    return top not in OURS and top not in sys.stdlib_module_names


def test_the_scan_finds_private_attributes_of_dependencies() -> None:
    assert private_attributes(
        "import aiohttp\nfrom aiohttp import connector\nfrom shared import cli\nimport os\n"
        "connector._SSL = 1\nx = getattr(aiohttp, '_y', None)\ncli._z\nos._exit\nself._a\naiohttp.__version__\n"
    ) == ["connector._SSL", "aiohttp._y"]


def test_no_product_source_uses_a_private_attribute_of_a_dependency() -> None:
    found = {
        str(path.relative_to(REPO)): names
        for top in ("shared", "services", "embedded")
        for path in sorted((REPO / top).rglob("*.py"))
        if GENERATED not in (text := path.read_text())[:300] and (names := private_attributes(text))
    }
    assert found == {}
