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
