"""No import cycles among the product's modules (`shared/`, `services/`): every import counts, a lazy one inside
a function too, since a cycle is a seam crossed both ways whenever the import runs."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Cycles left for later; nothing may join this list.
KNOWN: list[list[str]] = []


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` under `root` it imports (`from a import b` counts `a.b` when it is one)."""
    modules = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names += [f"{node.module}.{a.name}" for a in node.names]
        graph[module] = {m for m in map(known, names) if m is not None and m != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            child = next((e for e in edges if e not in index or e in stack), None)
            if child is not None and child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
                continue
            if child is not None:
                low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while (member := stack.pop()) != node:
                    component.append(member)
                component.append(node)
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_the_product_has_no_import_cycle() -> None:
    found = cycles(import_graph(REPO, ("shared", "services")))
    assert [c for c in found if c not in KNOWN] == []


def test_a_cycle_through_a_lazy_import_is_found(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.sub import b\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("import pkg.c\n")
    (tmp_path / "pkg" / "c.py").write_text("def f():\n    from pkg.a import f\n")
    (tmp_path / "pkg" / "d.py").write_text("import pkg.a\n")
    assert cycles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
