"""Compiles a Kubernetes-flavoured JSON/OpenAPI schema into a checker function, once, so that
validating an object is a walk of plain Python calls. Two dialects: the upstream built-in
definitions (`type` lists with "null", `$ref` into `$defs`, closed objects) and CRD structural
schemas (openAPIV3Schema: nullable, enum, bounds, pattern, x-kubernetes-* extensions).

A checker is `check(value, path, errors)`; it appends `FieldError`s and never raises.

Over ~400 lines on purpose: the value constraints (enum, bounds, combinators) call back into the
compiler, so they live beside it rather than in a module that would import it in a cycle."""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Callable
from typing import Any

from embedded.apiserver import _schemas_errors as fe
from embedded.apiserver._schemas_load import ref_name

Check = Callable[[Any, str, list[fe.FieldError]], None]

QUANTITY_DEF = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING_DEF = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"

_QUANTITY_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?\Z", re.ASCII)
_QUANTITY_MSG = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
_DATE_TIME_RE = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})\Z", re.ASCII)
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)

_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def is_type(value: object, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    types = _PY_TYPES.get(name)
    return types is not None and isinstance(value, types)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def type_error(path: str, value: object, wanted: str) -> fe.FieldError:
    got = json_type(value)
    where = path or "<root>"
    return fe.FieldError(
        fe.TYPE_INVALID, path, f"{where} in body must be of type {wanted}: {got!r}".replace("'", '"'), got
    )


def _any(value: Any, path: str, errors: list[fe.FieldError]) -> None:
    return None


def check_quantity(value: Any, path: str, errors: list[fe.FieldError]) -> None:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        errors.append(type_error(path, value, "string"))
    elif isinstance(value, str) and not _QUANTITY_RE.match(value):
        errors.append(fe.invalid(path, value, _QUANTITY_MSG))
    elif isinstance(value, float) and not math.isfinite(value):
        errors.append(fe.invalid(path, value, "must be a finite number"))


def _check_int_or_string(value: Any, path: str, errors: list[fe.FieldError]) -> None:
    if isinstance(value, bool) or not isinstance(value, str | int):
        errors.append(type_error(path, value, "integer or string"))


def _format_check(fmt: str, path: str, value: Any, errors: list[fe.FieldError]) -> None:
    if fmt == "int32" and isinstance(value, int) and not _INT32[0] <= value <= _INT32[1]:
        errors.append(fe.invalid(path, value, "must fit in a 32-bit integer"))
    elif fmt == "int64" and isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
        errors.append(fe.invalid(path, value, "must fit in a 64-bit integer"))
    elif fmt == "date-time" and isinstance(value, str) and not _DATE_TIME_RE.match(value):
        errors.append(fe.invalid(path, value, f"{path} in body must be of type date-time"))
    elif fmt == "byte" and isinstance(value, str):
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            errors.append(fe.invalid(path, value, f"{path} in body must be of type byte (base64)"))


class Compiler:
    """Compiles schemas of one dialect. `defs` resolves `$ref`s (built-in dialect); `crd` switches
    on the structural-schema rules (null needs `nullable`, unknown fields of an object with
    `properties` are reported unless x-kubernetes-preserve-unknown-fields)."""

    def __init__(self, defs: dict[str, dict[str, Any]] | None = None, *, crd: bool = False) -> None:
        self._defs = defs or {}
        self._crd = crd
        self._compiled: dict[str, Check] = {}

    def definition(self, name: str) -> Check:
        done = self._compiled.get(name)
        if done is not None:
            return done
        if name == QUANTITY_DEF:
            self._compiled[name] = check_quantity
            return check_quantity
        if name == INT_OR_STRING_DEF:
            self._compiled[name] = _check_int_or_string
            return _check_int_or_string
        schema = self._defs.get(name)
        if schema is None:
            raise KeyError(f"schema definition {name!r} not found")
        slot: list[Check] = []

        def forward(value: Any, path: str, errors: list[fe.FieldError]) -> None:
            slot[0](value, path, errors)

        self._compiled[name] = forward  # recursion (e.g. JSONSchemaProps) goes through the slot
        real = self.compile(schema)
        slot.append(real)
        self._compiled[name] = real
        return real

    def compile(self, schema: dict[str, Any]) -> Check:
        ref = schema.get("$ref")
        if ref is not None:
            return self.definition(ref_name(ref))
        if "allOf" in schema and len(schema) <= 3 and all(k in ("allOf", "description", "default") for k in schema):
            parts = schema["allOf"]
            if len(parts) == 1:
                return self.compile(parts[0])
        if schema.get("x-kubernetes-int-or-string"):
            return self._wrap_common(schema, _check_int_or_string)
        types = self._types(schema)
        if types is None:
            body: Check = _any
            if "properties" in schema or "additionalProperties" in schema:
                body = self._object(schema)
            return self._wrap_common(schema, body, nullable=True)
        nullable = "null" in types or bool(schema.get("nullable")) or not self._crd
        types = [t for t in types if t != "null"]
        if len(types) == 1:
            t = types[0]
            if t == "object":
                body = self._object(schema)
            elif t == "array":
                body = self._array(schema)
            else:
                body = self._scalar(schema, t)
        else:
            body = self._multi(types)
        return self._wrap_common(schema, body, nullable=nullable)

    # -- pieces -------------------------------------------------------------------------------
    def _types(self, schema: dict[str, Any]) -> list[str] | None:
        t = schema.get("type")
        if t is None:
            if self._crd and schema.get("x-kubernetes-preserve-unknown-fields"):
                return None
            return None
        return list(t) if isinstance(t, list) else [t]

    def _multi(self, types: list[str]) -> Check:
        wanted = " or ".join(types)

        def check(value: Any, path: str, errors: list[fe.FieldError]) -> None:
            if not any(is_type(value, t) for t in types):
                errors.append(type_error(path, value, wanted))

        return check

    def _scalar(self, schema: dict[str, Any], t: str) -> Check:
        fmt = schema.get("format")
        if t == "number" and fmt in ("int32", "int64"):
            t = "integer"

        def check(value: Any, path: str, errors: list[fe.FieldError]) -> None:
            if not is_type(value, t):
                errors.append(type_error(path, value, t))
            elif fmt is not None:
                _format_check(fmt, path, value, errors)

        return check

    def _array(self, schema: dict[str, Any]) -> Check:
        items = schema.get("items")
        item_check = self.compile(items) if isinstance(items, dict) else _any
        list_type = schema.get("x-kubernetes-list-type") if self._crd else None
        map_keys = schema.get("x-kubernetes-list-map-keys") or []

        def check(value: Any, path: str, errors: list[fe.FieldError]) -> None:
            if not isinstance(value, list):
                errors.append(type_error(path, value, "array"))
                return
            for i, item in enumerate(value):
                item_check(item, f"{path}[{i}]", errors)
            if list_type == "set":
                _unique_items(value, path, errors)
            elif list_type == "map" and map_keys:
                _unique_map_keys(value, map_keys, path, errors)

        return check

    def _object(self, schema: dict[str, Any]) -> Check:
        props_schema: dict[str, Any] = schema.get("properties") or {}
        props = {name: self.compile(sub) for name, sub in props_schema.items()}
        required = tuple(schema.get("required") or ())
        addl = schema.get("additionalProperties")
        preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        embedded = bool(schema.get("x-kubernetes-embedded-resource"))
        addl_check: Check | None = None
        closed = False
        if isinstance(addl, dict):
            addl_check = self.compile(addl)
        elif addl is False:
            closed = True
        elif addl is None and self._crd and not preserve and not embedded:
            closed = bool(props) or "properties" in schema
        implicit = ("apiVersion", "kind", "metadata") if embedded else ()
        crd = self._crd

        def check(value: Any, path: str, errors: list[fe.FieldError]) -> None:
            if not isinstance(value, dict):
                errors.append(type_error(path, value, "object"))
                return
            for key, item in value.items():
                sub = props.get(key)
                if sub is not None:
                    if item is not None or crd:
                        sub(item, f"{path}.{key}" if path else key, errors)
                elif addl_check is not None:
                    if item is not None or crd:
                        addl_check(item, f"{path}[{key}]", errors)
                elif closed and key not in implicit:
                    errors.append(
                        fe.FieldError(
                            fe.UNKNOWN_FIELD, f"{path}.{key}" if path else key, "field not declared in schema"
                        )
                    )
            for key in required:
                if value.get(key) is None:
                    errors.append(fe.required(f"{path}.{key}" if path else key))

        return check

    def _wrap_common(self, schema: dict[str, Any], body: Check, *, nullable: bool = True) -> Check:
        """Adds null handling and, for CRDs, the value constraints (enum, bounds, lengths, pattern)."""
        # built-in definitions only carry `enum` (on apiVersion/kind); CRDs carry the full set
        extra = _value_constraints(schema, self) if self._crd or "enum" in schema else []
        if not extra and nullable:
            if body is _any:
                return _any

            def plain(value: Any, path: str, errors: list[fe.FieldError]) -> None:
                if value is not None:
                    body(value, path, errors)

            return plain

        def full(value: Any, path: str, errors: list[fe.FieldError]) -> None:
            if value is None:
                if not nullable:
                    errors.append(type_error(path, value, _first_type(schema)))
                return
            before = len(errors)
            body(value, path, errors)
            if len(errors) == before:
                for constraint in extra:
                    constraint(value, path, errors)

        return full


def _first_type(schema: dict[str, Any]) -> str:
    t = schema.get("type", "object")
    return t if isinstance(t, str) else next((x for x in t if x != "null"), "object")


def _unique_items(value: list[Any], path: str, errors: list[fe.FieldError]) -> None:
    seen: list[Any] = []
    for i, item in enumerate(value):
        if item in seen:
            errors.append(fe.duplicate(f"{path}[{i}]", item))
        else:
            seen.append(item)


def _unique_map_keys(value: list[Any], keys: list[str], path: str, errors: list[fe.FieldError]) -> None:
    seen: set[str] = set()
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            continue
        ident = repr(tuple(item.get(k) for k in keys))
        if ident in seen:
            shown = {k: item.get(k) for k in keys if k in item}
            errors.append(fe.duplicate(f"{path}[{i}]", shown))
        seen.add(ident)


def _value_constraints(schema: dict[str, Any], compiler: Compiler) -> list[Check]:
    checks: list[Check] = []
    enum = schema.get("enum")
    if enum is not None:
        allowed = list(enum)
        shown = [str(v) for v in allowed]

        def check_enum(value: Any, path: str, errors: list[fe.FieldError]) -> None:
            if value not in allowed or isinstance(value, bool) != any(
                isinstance(a, bool) and a == value for a in allowed
            ):
                errors.append(fe.not_supported(path, value, shown))

        checks.append(check_enum)
    for key, op, word in (("maximum", "gt", "less than or equal to"), ("minimum", "lt", "greater than or equal to")):
        if key in schema:
            bound = schema[key]
            exclusive = bool(schema.get("exclusiveMaximum" if key == "maximum" else "exclusiveMinimum"))
            checks.append(_bound_check(bound, op, exclusive, word))
    for key, kind, limit_word in (
        ("maxLength", str, "at most"),
        ("minLength", str, "at least"),
        ("maxItems", list, "at most"),
        ("minItems", list, "at least"),
        ("maxProperties", dict, "at most"),
        ("minProperties", dict, "at least"),
    ):
        if key in schema:
            checks.append(_size_check(int(schema[key]), kind, key.startswith("max"), limit_word))
    pattern = schema.get("pattern")
    if pattern is not None:
        rx = go_regexp(pattern)

        def check_pattern(value: Any, path: str, errors: list[fe.FieldError]) -> None:
            if isinstance(value, str) and not rx.search(value):
                errors.append(fe.invalid(path, value, f"{path} in body should match '{pattern}'"))

        checks.append(check_pattern)
    if "multipleOf" in schema:
        step = schema["multipleOf"]

        def check_multiple(value: Any, path: str, errors: list[fe.FieldError]) -> None:
            if is_type(value, "number") and step and (value / step) % 1:
                errors.append(fe.invalid(path, value, f"{path} in body should be a multiple of {step}"))

        checks.append(check_multiple)
    for key in ("allOf", "anyOf", "oneOf", "not"):
        if key in schema:
            checks.append(_combinator(key, schema[key], compiler))
    return checks


def _bound_check(bound: float, op: str, exclusive: bool, word: str) -> Check:
    def check(value: Any, path: str, errors: list[fe.FieldError]) -> None:
        if not is_type(value, "number"):
            return
        bad = (
            (value >= bound if exclusive else value > bound)
            if op == "gt"
            else (value <= bound if exclusive else value < bound)
        )
        if bad:
            strict = word.replace(" or equal to", "") if exclusive else word
            errors.append(fe.invalid(path, value, f"{path} in body should be {strict} {bound}"))

    return check


def _size_check(limit: int, kind: type[Any], is_max: bool, limit_word: str) -> Check:
    units: dict[type[Any], str] = {str: "chars long", list: "items", dict: "properties"}
    unit = units[kind]

    def check(value: Any, path: str, errors: list[fe.FieldError]) -> None:
        if not isinstance(value, kind) or isinstance(value, bool):
            return
        size = len(value)  # a str, list or dict here
        if is_max and size > limit:
            if kind is list:
                errors.append(fe.too_many(path, size, limit))
            elif kind is str:
                errors.append(fe.too_long(path, limit))
            else:
                errors.append(fe.too_many(path, size, limit))
        elif not is_max and size < limit:
            errors.append(
                fe.invalid(
                    path, value if kind is str else size, f"{path} in body should be {limit_word} {limit} {unit}"
                )
            )

    return check


def _combinator(key: str, sub: Any, compiler: Compiler) -> Check:
    # value-validation combinators of a structural schema: they constrain, they never add fields
    value_compiler = Compiler(crd=False)
    if key == "not":
        inner = value_compiler.compile(sub)

        def check_not(value: Any, path: str, errors: list[fe.FieldError]) -> None:
            trial: list[fe.FieldError] = []
            inner(value, path, trial)
            if not trial:
                errors.append(fe.invalid(path, value, f"{path} in body must not validate the schema (not)"))

        return check_not
    parts = [Compiler(crd=True).compile(dict(s, **{"x-kubernetes-preserve-unknown-fields": True})) for s in sub]

    def check(value: Any, path: str, errors: list[fe.FieldError]) -> None:
        results = []
        for part in parts:
            trial: list[fe.FieldError] = []
            part(value, path, trial)
            results.append(trial)
        passed = sum(1 for r in results if not r)
        if key == "allOf":
            for r in results:
                errors.extend(r)
        elif key == "anyOf" and not passed:
            errors.append(fe.invalid(path, value, f"{path} in body must validate at least one schema (anyOf)"))
        elif key == "oneOf" and passed != 1:
            errors.append(fe.invalid(path, value, f"{path} in body must validate one and only one schema (oneOf)"))

    return check


def go_regexp(pattern: str) -> re.Pattern[str]:
    """A schema `pattern` compiled to match as the API server's Go regexp does: there `$` (and `\\z`) is the
    end of the text, where Python's `$` also matches before a trailing newline ("abc\\n" would pass
    `^[a-z]+$`), and `\\d`, `\\w`, `\\s` and `\\b` are ASCII only. Each `$` outside a character class
    becomes `\\Z`; the rest is left as written. A pattern that turns on multi-line mode (`(?m)`: `$` at each
    line's end, in both) keeps its `$`."""
    if re.search(r"\(\?[a-zA-Z]*m", pattern):
        return re.compile(pattern, re.ASCII)
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            out.append("\\Z" if nxt == "z" and not in_class else c + nxt)
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
        elif c == "[":
            in_class = True
            out.append(c)
            i += 1
            if pattern[i : i + 1] == "^":  # a negated class
                out.append("^")
                i += 1
            if pattern[i : i + 1] == "]":  # a `]` first in a class is one of its characters
                out.append("]")
                i += 1
            continue
        elif c == "$":
            c = "\\Z"
        out.append(c)
        i += 1
    return re.compile("".join(out), re.ASCII)  # \d \w \s \b: ASCII in Go
