"""The published event contract, read from `gpu-dra events schema --out DIR`: which subject and stream
carry claim lifecycle events, and a small JSON Schema checker for their messages.

The checker covers the subset the exported schemas use (type, enum, const, required, properties,
additionalProperties, items, $ref into $defs, anyOf/oneOf) so the ledger needs nothing but nats-py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLAIM_ENTRY = "claim-lifecycle"

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


class ContractError(ValueError):
    """The schema directory is missing or does not describe claim lifecycle events."""


class SchemaViolation(ValueError):
    """A message does not match its published schema; the text names the field."""


@dataclass(frozen=True)
class Contract:
    """Where claim lifecycle events are and what they look like."""

    subject_pattern: str  # e.g. dra.v1.claim.{namespace}.{node}.{event}
    filter_subject: str  # e.g. dra.v1.claim.*.*.*
    stream: str
    retention_s: float
    schema: dict[str, Any]
    binds: dict[str, str] = field(default_factory=dict)  # subject token -> the body field it authenticates

    def check(self, message: Any) -> None:
        check(message, self.schema, self.schema, "$")

    def scoped(self, namespace: str) -> str:
        """The filter subject narrowed to one namespace token."""
        tokens = self.subject_pattern.split(".")
        filters = self.filter_subject.split(".")
        if "{namespace}" not in tokens:
            raise ContractError(f"subject {self.subject_pattern} has no namespace token")
        filters[tokens.index("{namespace}")] = namespace
        return ".".join(filters)


def _covers(stream_subject: str, filter_subject: str) -> bool:
    """Whether a stream subject pattern (may end in `>`) holds every subject the filter matches."""
    s_tokens, f_tokens = stream_subject.split("."), filter_subject.split(".")
    for i, s in enumerate(s_tokens):
        if s == ">":
            return len(f_tokens) > i
        if i >= len(f_tokens):
            return False
        if s != "*" and s != f_tokens[i]:
            return False
    return len(s_tokens) == len(f_tokens)


def load_contract(schema_dir: Path) -> Contract:
    """Read index.json and the claim lifecycle schema; ContractError says what is missing."""
    index_path = schema_dir / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except FileNotFoundError:
        raise ContractError(
            f"{index_path} not found; write the schemas first: gpu-dra events schema --out {schema_dir}"
        ) from None
    except json.JSONDecodeError as exc:
        raise ContractError(f"{index_path} is not JSON ({exc}); regenerate it with gpu-dra events schema") from None
    entries = [e for e in index.get("subjects", []) if e.get("name") == CLAIM_ENTRY]
    if not entries:
        raise ContractError(f"{index_path} lists no {CLAIM_ENTRY!r} subject; is it the driver's schema index?")
    entry = entries[0]
    streams = [s for s in index.get("streams", [])
               if any(_covers(subject, entry["subscribe"]) for subject in s.get("subjects", []))]
    if not streams:
        raise ContractError(f"no stream in {index_path} stores {entry['subscribe']}")
    schema_path = schema_dir / entry["schema"]
    try:
        schema = json.loads(schema_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise ContractError(f"cannot read {schema_path}: {exc}") from None
    stream = streams[0]
    binds = entry.get("binds") or {}
    unknown = [name for name in binds if f"{{{name}}}" not in entry["subject"]]
    if not isinstance(binds, dict) or unknown:
        raise ContractError(f"{index_path}: binds {binds!r} of {CLAIM_ENTRY!r} name tokens not in {entry['subject']}")
    return Contract(entry["subject"], entry["subscribe"], stream["name"],
                    float(stream.get("max_age_s") or 7 * 24 * 3600), schema, {str(k): str(v) for k, v in binds.items()})


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise SchemaViolation(f"unsupported $ref {ref!r} (only local #/... references)")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return dict(node)


def check(value: Any, schema: dict[str, Any], root: dict[str, Any], path: str) -> None:
    """Raise SchemaViolation naming the first place where `value` breaks `schema`."""
    if "$ref" in schema:
        check(value, _resolve(schema["$ref"], root), root, path)
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(isinstance(value, _TYPES[n]) and not (n in ("integer", "number") and isinstance(value, bool))
                 for n in names)
        if not ok:
            raise SchemaViolation(f"{path}: expected {' or '.join(names)}, got {type(value).__name__}")
    if "enum" in schema and value not in schema["enum"]:
        raise SchemaViolation(f"{path}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        raise SchemaViolation(f"{path}: must be {schema['const']!r}")
    for key in ("anyOf", "oneOf"):
        if key in schema:
            errors = []
            for option in schema[key]:
                try:
                    check(value, option, root, path)
                    break
                except SchemaViolation as exc:
                    errors.append(str(exc))
            else:
                raise SchemaViolation(f"{path}: matches none of the allowed forms ({'; '.join(errors)})")
    if isinstance(value, dict):
        for name in schema.get("required", []):
            if name not in value:
                raise SchemaViolation(f"{path}: required field {name!r} is missing")
        properties = schema.get("properties", {})
        for name, item in value.items():
            if name in properties:
                check(item, properties[name], root, f"{path}.{name}")
            elif schema.get("additionalProperties") is False:
                raise SchemaViolation(f"{path}: unexpected field {name!r}")
            elif isinstance(schema.get("additionalProperties"), dict):  # a map: each value has this schema
                check(item, schema["additionalProperties"], root, f"{path}.{name}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            check(item, schema["items"], root, f"{path}[{i}]")
