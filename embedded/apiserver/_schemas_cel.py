"""CRD validation rules (`x-kubernetes-validations`, CEL): evaluated on create and update the way the
real server does, `self` bound to the value at the rule's place and, for transition rules (those
naming `oldSelf`), `oldSelf` to the old value there (skipped when there is none). Old values are
correlated through object properties, map keys and list-type=map keys. Also the syntax check of
rules when a CRD is created or updated."""

from __future__ import annotations

import functools
from typing import Any

from embedded.apiserver import _schemas_errors as fe
from embedded.apiserver._schemas_check import json_type

_REASONS = {"FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired", "FieldValueDuplicate"}
_ABSENT = object()


@functools.lru_cache(maxsize=1024)
def _program(rule: str) -> Any:
    """The compiled rule, or the parser's message (a str) when it does not parse."""
    try:
        import cel  # common-expression-language
    except ImportError:  # validation rules then go unchecked; the structural schema still applies
        return None
    try:
        return cel.compile(rule)
    except ValueError as exc:
        text = str(exc)
        marker = text.find("ERROR:")
        return text[marker:] if marker >= 0 else text


def check_rules(schema: dict[str, Any], value: Any, old: Any, path: str, errors: list[fe.FieldError]) -> None:
    """Appends a FieldError for every rule under `schema` that `value` breaks. `old` is the old
    value at the same place, or `_ABSENT`/None when there is none."""
    if value is None or not isinstance(schema, dict):
        return
    for rule in schema.get("x-kubernetes-validations") or ():
        _apply(rule, value, old, path, errors)
    properties = schema.get("properties")
    if isinstance(value, dict):
        old_map = old if isinstance(old, dict) else {}
        if isinstance(properties, dict):
            for key, sub in properties.items():
                if key in value:
                    check_rules(sub, value[key], old_map.get(key, _ABSENT), f"{path}.{key}" if path else key, errors)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                if not isinstance(properties, dict) or key not in properties:
                    check_rules(extra, item, old_map.get(key, _ABSENT), f"{path}[{key}]", errors)
    items = schema.get("items")
    if isinstance(value, list) and isinstance(items, dict):
        keys = schema.get("x-kubernetes-list-map-keys") if schema.get("x-kubernetes-list-type") == "map" else None
        old_items = _old_items_by_key(old, keys) if keys else {}
        for i, item in enumerate(value):
            previous: Any = _ABSENT
            if keys and isinstance(item, dict):
                previous = old_items.get(tuple(repr(item.get(k)) for k in keys), _ABSENT)
            check_rules(items, item, previous, f"{path}[{i}]", errors)


def _old_items_by_key(old: Any, keys: list[str]) -> dict[tuple[str, ...], Any]:
    if not isinstance(old, list):
        return {}
    return {tuple(repr(item.get(k)) for k in keys): item for item in old if isinstance(item, dict)}


def _apply(rule: dict[str, Any], value: Any, old: Any, path: str, errors: list[fe.FieldError]) -> None:
    text = rule.get("rule")
    if not isinstance(text, str) or not text:
        return
    transition = "oldSelf" in text
    if transition and (old is _ABSENT or old is None) and not rule.get("optionalOldSelf"):
        return
    program = _program(text)
    if program is None or isinstance(program, str):
        return  # a rule that does not parse was refused when the CRD was written
    context: dict[str, Any] = {"self": value}
    if transition:
        context["oldSelf"] = None if old is _ABSENT else old
    where = path
    field_path = rule.get("fieldPath")
    if isinstance(field_path, str) and field_path:
        where = f"{path}{field_path}" if field_path.startswith((".", "[")) else f"{path}.{field_path}"
    try:
        result = program.execute(context)
    except Exception as exc:  # a runtime error (no such key, bad types) fails the rule, as upstream
        errors.append(fe.invalid(where, json_type(value), f"{exc} evaluating rule: {text}"))
        return
    if result is True:
        return
    message = rule.get("message") or f"failed rule: {text}"
    reason = str(rule["reason"]) if rule.get("reason") in _REASONS else fe.INVALID
    if reason == fe.INVALID:
        errors.append(fe.invalid(where, json_type(value), message))
    else:
        errors.append(fe.FieldError(reason, where, message))


def rule_syntax_errors(schema: Any, path: str, errors: list[fe.FieldError]) -> None:
    """Reports every x-kubernetes-validations rule under `schema` that does not parse (CRD writes)."""
    if not isinstance(schema, dict):
        return
    for i, rule in enumerate(schema.get("x-kubernetes-validations") or ()):
        text = rule.get("rule") if isinstance(rule, dict) else None
        if isinstance(text, str):
            program = _program(text)
            if isinstance(program, str):
                errors.append(
                    fe.invalid(f"{path}.x-kubernetes-validations[{i}].rule", text, f"compilation failed: {program}")
                )
    for key, sub in (schema.get("properties") or {}).items():
        rule_syntax_errors(sub, f"{path}.properties[{key}]", errors)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            rule_syntax_errors(schema[key], f"{path}.{key}", errors)
