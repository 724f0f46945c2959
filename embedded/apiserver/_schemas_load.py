"""Finds and loads the upstream OpenAPI definitions that the `kubernetes-validate` package ships
(one `_definitions.json` per Kubernetes minor, strict variant: every typed object closed with
`additionalProperties: false`), and indexes them by group/version/kind. Loaded once, cached.

How refs resolve: the per-kind files point at `/api/_definitions.json#/$defs/<name>` and the
definitions point at each other as `#/$defs/<name>`; both are looked up here by `<name>` alone."""

from __future__ import annotations

import functools
import importlib.resources
import re
from typing import Any

import msgspec

_PACKAGE = "kubernetes_validate"
_DIR_RE = re.compile(r"^v(\d+)\.(\d+)\.(\d+)-local-strict\Z", re.ASCII)
_REF_PREFIX = "#/$defs/"


class SchemaSetMissing(RuntimeError):
    """The `kubernetes-validate` package or its schema folders are not installed."""


@functools.cache
def schema_versions() -> tuple[str, ...]:
    """Kubernetes versions with a strict schema set, newest first, e.g. ("1.37", "1.36", ...)."""
    try:
        root = importlib.resources.files(_PACKAGE).joinpath("kubernetes-json-schema")
        names = [entry.name for entry in root.iterdir()]
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise SchemaSetMissing(
            f"no Kubernetes schemas: the {_PACKAGE!r} package is not installed ({exc}); "
            "install the project's dependencies (make .venv/.installed)"
        ) from exc
    found = []
    for name in names:
        m = _DIR_RE.match(name)
        if m:
            found.append((int(m.group(1)), int(m.group(2)), f"{m.group(1)}.{m.group(2)}"))
    if not found:
        raise SchemaSetMissing(f"the {_PACKAGE!r} package holds no strict schema folders")
    return tuple(v for _, _, v in sorted(found, reverse=True))


@functools.cache
def definitions(k8s_version: str) -> dict[str, dict[str, Any]]:
    """All definitions of one Kubernetes version, keyed like `io.k8s.api.resource.v1.ResourceSlice`."""
    path = importlib.resources.files(_PACKAGE).joinpath(
        "kubernetes-json-schema", f"v{k8s_version}.0-local-strict", "_definitions.json"
    )
    document = msgspec.json.decode(path.read_bytes())
    defs: dict[str, dict[str, Any]] = document["$defs"]
    return defs


@functools.cache
def gvk_index(k8s_version: str) -> dict[tuple[str, str, str], str]:
    """(group, version, kind) -> definition name, from each definition's x-kubernetes-group-version-kind."""
    index: dict[tuple[str, str, str], str] = {}
    for name, schema in definitions(k8s_version).items():
        for gvk in schema.get("x-kubernetes-group-version-kind", ()):
            index.setdefault((gvk.get("group", ""), gvk["version"], gvk["kind"]), name)
    return index


def find_definition(group: str, version: str, kind: str) -> tuple[str, str] | None:
    """(kubernetes version, definition name) from the newest bundled version that has the kind."""
    for k8s_version in schema_versions():
        name = gvk_index(k8s_version).get((group, version, kind))
        if name is not None:
            return k8s_version, name
    return None


def ref_name(ref: str) -> str:
    """`/api/_definitions.json#/$defs/X` or `#/$defs/X` -> `X`."""
    _, sep, name = ref.partition(_REF_PREFIX)
    if not sep:
        raise ValueError(f"unsupported $ref {ref!r}: expected one into #/$defs/")
    return name
