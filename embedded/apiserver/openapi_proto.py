"""/openapi/v2 as protobuf: the Swagger 2.0 document as gnostic's `openapi.v2.Document`, which
client-go (kubectl's validation, `apply`) asks for with
Accept: application/com.github.proto-openapi.spec.v2@v1.0+protobuf and cannot read as JSON.

Field numbers are those of gnostic's openapiv2/OpenAPIv2.proto (Document, Info, Definitions,
NamedSchema, Schema, TypeItem, ItemsItem, Properties, AdditionalPropertiesItem, NamedAny, Any).
Values the message has no typed field for (default, enum, example, x-* extensions) go, as gnostic
writes them, into Any.yaml: JSON text, which is YAML. Paths are left out: clients read only the
definitions (models by x-kubernetes-group-version-kind)."""

from __future__ import annotations

from typing import Any

import msgspec

from embedded.apiserver.wire import bool_field as _bool
from embedded.apiserver.wire import bytes_field as _bytes
from embedded.apiserver.wire import double_field as _double
from embedded.apiserver.wire import int_field as _int
from embedded.apiserver.wire import str_field as _str
from embedded.apiserver.wire import varint as _varint

MEDIA_TYPE = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"
RESPONSE_TYPE = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"  # what kube-apiserver answers


def wants_protobuf(accept: str) -> bool:
    return "application/com.github.proto-openapi.spec.v2" in accept


def _any(value: Any) -> bytes:
    return _str(2, msgspec.json.encode(value).decode())  # Any.yaml


def _named_any(field: int, name: str, value: Any) -> bytes:
    return _bytes(field, _str(1, name) + _bytes(2, _any(value)))


def schema(s: dict[str, Any]) -> bytes:
    """One Schema message."""
    out = [
        _str(1, s.get("$ref", "")),
        _str(2, s.get("format", "")),
        _str(3, s.get("title", "")),
        _str(4, s.get("description", "")),
    ]
    if "default" in s:
        out.append(_bytes(5, _any(s["default"])))
    for name, field in (("multipleOf", 6), ("maximum", 7), ("minimum", 9)):
        if isinstance(s.get(name), int | float):
            out.append(_double(field, s[name]))
    out += [_bool(8, bool(s.get("exclusiveMaximum"))), _bool(10, bool(s.get("exclusiveMinimum")))]
    for name, field in (
        ("maxLength", 11),
        ("minLength", 12),
        ("maxItems", 14),
        ("minItems", 15),
        ("maxProperties", 17),
        ("minProperties", 18),
    ):
        if isinstance(s.get(name), int):
            out.append(_int(field, s[name]))
    out += [_str(13, s.get("pattern", "")), _bool(16, bool(s.get("uniqueItems")))]
    out += [_str(19, r) for r in s.get("required") or []]
    out += [_bytes(20, _any(v)) for v in s.get("enum") or []]
    extra = s.get("additionalProperties")
    if isinstance(extra, dict):
        out.append(_bytes(21, _bytes(1, schema(extra))))
    elif isinstance(extra, bool):
        out.append(_bytes(21, _varint(2 << 3) + (b"\x01" if extra else b"\x00")))
    kind = s.get("type")
    if kind:
        out.append(_bytes(22, b"".join(_str(1, t) for t in (kind if isinstance(kind, list) else [kind]))))
    items = s.get("items")
    if isinstance(items, dict | list):
        out.append(_bytes(23, b"".join(_bytes(1, schema(i)) for i in (items if isinstance(items, list) else [items]))))
    out += [_bytes(24, schema(a)) for a in s.get("allOf") or []]
    props = s.get("properties")
    if isinstance(props, dict):
        out.append(_bytes(25, b"".join(_bytes(1, _str(1, name) + _bytes(2, schema(p))) for name, p in props.items())))
    out += [_str(26, s.get("discriminator", "")), _bool(27, bool(s.get("readOnly")))]
    if "example" in s:
        out.append(_bytes(30, _any(s["example"])))
    out += [_named_any(31, key, value) for key, value in s.items() if key.startswith("x-")]
    return b"".join(out)


def document(doc: dict[str, Any]) -> bytes:
    """The Swagger 2.0 document (as /openapi/v2 serves it in JSON) -> an openapi.v2.Document."""
    info = doc.get("info") or {}
    definitions = doc.get("definitions") or {}
    return b"".join(
        [
            _str(1, doc.get("swagger", "2.0")),
            _bytes(2, _str(1, info.get("title", "")) + _str(2, info.get("version", ""))),
            _bytes(9, b"".join(_bytes(1, _str(1, name) + _bytes(2, schema(s))) for name, s in definitions.items())),
        ]
    )
