"""Version conversion and validation hooks: storage version <-> served version, and the checks.

`validation.py` and `conversion.py` are separate modules (schema validation and resource.k8s.io
v1 <-> v1beta1); this module is the one place the core calls them, so the core does not care
whether a kind is built-in, DRA or custom.
"""

from __future__ import annotations

import importlib
from typing import Any

from embedded.apiserver.resources import Resource

_cache: dict[str, Any] = {}


def _module(name: str) -> Any:
    if name not in _cache:
        try:
            _cache[name] = importlib.import_module(f"embedded.apiserver.{name}")
        except ImportError:
            _cache[name] = None
    return _cache[name]


def to_storage(res: Resource, obj: dict[str, Any], version: str) -> dict[str, Any]:
    """An object in a served version -> the same object in the storage version."""
    return convert(res, obj, res.storage_version) if version != res.storage_version else obj


def convert(res: Resource, obj: dict[str, Any], version: str) -> dict[str, Any]:
    """`obj` (any served version of `res`) in `version`; the input is never mutated."""
    current = obj.get("apiVersion", "").rsplit("/", 1)[-1]
    if current == version:
        return obj
    if res.group == "resource.k8s.io":
        conversion = _module("conversion")
        if conversion is not None:
            return conversion.convert_resource(obj, version)  # type: ignore[no-any-return]
    out = dict(obj)
    out["apiVersion"] = res.api_version(version)
    return out


def validate(res: Resource, version: str, obj: dict[str, Any], old: dict[str, Any] | None) -> list[Any]:
    """FieldErrors for `obj` in `version` (with `old` in the same version on update)."""
    validation = _module("validation")
    if validation is None:
        return []
    if res.is_custom:
        schema = res.schemas.get(version)
        if not schema:
            schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return list(validation.validate_custom(schema, obj, old, kind=res.kind, namespaced=res.namespaced))
    return list(validation.validate_object(res.group, version, res.kind, obj, old))


def prune(obj: dict[str, Any], unknown: list[Any]) -> dict[str, Any]:
    """`obj` without the unknown fields (fieldValidation Warn/Ignore drop them, as upstream decoding does)."""
    validation = _module("validation")
    if validation is None or not unknown:
        return obj
    return validation.prune_unknown(obj, unknown)  # type: ignore[no-any-return]


def strict_message(res: Resource, version: str, unknown: list[Any]) -> str:
    fields = ", ".join(f'unknown field "{e.field}"' for e in unknown)
    return f'{res.kind} in version "{version}" cannot be handled as a {res.kind}: strict decoding error: {fields}'
