"""The compatibility promise, checked: a catalog's schemas against the released ones.

Within a subject version fields are only added (docs/events.md). `breaking_changes(released, current)`
lists what a consumer of the released schemas could trip on: a subject or message gone, a subject
pattern changed, a field removed, a field's type changed, a field newly required, an enum value
removed. Adding subjects, messages, optional fields or enum values is allowed. The released schemas
are the output of `gpu-dra events schema` (index.json + one file per message), kept under
`tests/fixtures/events/v1/`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Schemas = dict[str, dict[str, Any]]  # file name -> schema, index.json included


def load(directory: Path) -> Schemas:
    return {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref", "")
    if ref.startswith("#/$defs/"):
        return dict(defs.get(ref.rsplit("/", 1)[1], {}))
    return schema


def _shape(schema: dict[str, Any], defs: dict[str, Any]) -> Any:
    """What a field's type is, ignoring documentation: compared between releases."""
    if "$ref" in schema:
        return ("ref", schema["$ref"].rsplit("/", 1)[1])
    if "anyOf" in schema:
        return ("anyOf", tuple(sorted(map(repr, (_shape(s, defs) for s in schema["anyOf"])))))
    if "enum" in schema:
        return ("enum",)  # values compared separately: adding one is allowed
    kind = schema.get("type")
    if kind == "array":
        return ("array", _shape(schema.get("items", {}), defs))
    if kind == "object" and "additionalProperties" in schema:
        return ("map", _shape(schema["additionalProperties"], defs))
    return ("type", kind)


def _compare_object(
    where: str,
    old: dict[str, Any],
    new: dict[str, Any],
    old_defs: dict[str, Any],
    new_defs: dict[str, Any],
    out: list[str],
    seen: set[str],
) -> None:
    old_props, new_props = old.get("properties", {}), new.get("properties", {})
    for field, old_field in old_props.items():
        if field not in new_props:
            out.append(f"{where}: field {field!r} removed")
            continue
        new_field = new_props[field]
        if _shape(old_field, old_defs) != _shape(new_field, new_defs):
            out.append(f"{where}: field {field!r} changed type")
        removed = set(map(str, old_field.get("enum", []))) - set(map(str, new_field.get("enum", [])))
        if removed:
            out.append(f"{where}: field {field!r} lost enum values {sorted(removed)}")
        for old_ref, new_ref in (
            (_resolve(old_field, old_defs), _resolve(new_field, new_defs)),
            *[
                (_resolve(a, old_defs), _resolve(b, new_defs))
                for a, b in zip(old_field.get("anyOf", []), new_field.get("anyOf", []), strict=False)
            ],
            (_resolve(old_field.get("items", {}), old_defs), _resolve(new_field.get("items", {}), new_defs)),
        ):
            title = old_ref.get("title", "")
            if old_ref.get("properties") and title and title not in seen:
                seen.add(title)
                _compare_object(f"{where}.{field} ({title})", old_ref, new_ref, old_defs, new_defs, out, seen)
    newly_required = set(new.get("required", [])) - set(old.get("required", []))
    for field in sorted(newly_required):
        out.append(f"{where}: field {field!r} newly required")


def breaking_changes(released: Schemas, current: Schemas) -> list[str]:
    """Every breaking change from `released` to `current` (empty: compatible)."""
    out: list[str] = []
    old_index, new_index = released["index.json"], current["index.json"]
    new_subjects = {s["name"]: s for s in new_index["subjects"]}
    for subject in old_index["subjects"]:
        now = new_subjects.get(subject["name"])
        if now is None:
            out.append(f"subject {subject['name']!r} ({subject['subject']}) removed")
            continue
        for key in ("subject", "schema", "pattern"):
            if now.get(key) != subject.get(key):
                out.append(f"subject {subject['name']!r}: {key} changed {subject.get(key)!r} -> {now.get(key)!r}")
    new_buckets = {b["name"] for b in new_index["buckets"]}
    out += [f"KV bucket {b['name']!r} removed" for b in old_index["buckets"] if b["name"] not in new_buckets]
    new_streams = {s["name"] for s in new_index["streams"]}
    out += [f"stream {s['name']!r} removed" for s in old_index["streams"] if s["name"] not in new_streams]
    for name, old in released.items():
        if name == "index.json":
            continue
        new = current.get(name)
        if new is None:
            out.append(f"message schema {name} removed")
            continue
        _compare_object(name.removesuffix(".json"), old, new, old.get("$defs", {}), new.get("$defs", {}), out, set())
    return out
