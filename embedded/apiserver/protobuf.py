"""Kubernetes protobuf request bodies (`application/vnd.kubernetes.protobuf`) for the kinds that
`kubectl create <kind>` sends that way: Namespace, ConfigMap, Secret, ServiceAccount, and the
SelfSubjectAccessReview and SelfSubjectRulesReview of `kubectl auth can-i [--list]` and TokenRequest of `kubectl create token`.

kubectl's typed subcommands encode their body as the `k8s\\0` magic followed by a runtime.Unknown
envelope whose `raw` field holds the object's protobuf. This module decodes those into the JSON
shape; the field numbers are the upstream generated.proto ones. Other kinds get a 415 that says
to send JSON (`kubectl apply -f` / `create -f` always does). Responses are always JSON, which
clients accept (`Accept: application/vnd.kubernetes.protobuf,application/json`).
"""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"


class ProtobufError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(buf):
            raise ProtobufError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) for each field; length-delimited values are bytes."""
    out, pos = [], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
        out.append((num, wire, value))
    return out


# A schema maps field number -> (json name, kind); kind is "str", "bytes" (base64 in JSON), "int",
# "bool", "time", "map", "bmap" (map of bytes), "strs" (repeated string), or a nested schema
# (dict), or ("list", schema) for repeated messages.
Schema = dict[int, tuple[str, Any]]

OWNER_REFERENCE: Schema = {1: ("kind", "str"), 3: ("name", "str"), 4: ("uid", "str"), 5: ("apiVersion", "str"),
                           6: ("controller", "bool"), 7: ("blockOwnerDeletion", "bool")}
OBJECT_META: Schema = {
    1: ("name", "str"), 2: ("generateName", "str"), 3: ("namespace", "str"), 5: ("uid", "str"),
    6: ("resourceVersion", "str"), 7: ("generation", "int"), 8: ("creationTimestamp", "time"),
    11: ("labels", "map"), 12: ("annotations", "map"), 13: ("ownerReferences", ("list", OWNER_REFERENCE)),
    14: ("finalizers", "strs"),
}
OBJECT_REFERENCE: Schema = {1: ("kind", "str"), 2: ("namespace", "str"), 3: ("name", "str"), 4: ("uid", "str"),
                            5: ("apiVersion", "str")}
LOCAL_REFERENCE: Schema = {1: ("name", "str")}

KINDS: dict[tuple[str, str], Schema] = {
    ("v1", "Namespace"): {1: ("metadata", OBJECT_META), 2: ("spec", {1: ("finalizers", "strs")})},
    ("v1", "ConfigMap"): {1: ("metadata", OBJECT_META), 2: ("data", "map"), 3: ("binaryData", "bmap"),
                          4: ("immutable", "bool")},
    ("v1", "Secret"): {1: ("metadata", OBJECT_META), 2: ("data", "bmap"), 3: ("type", "str"),
                       4: ("stringData", "map"), 5: ("immutable", "bool")},
    ("v1", "ServiceAccount"): {1: ("metadata", OBJECT_META), 2: ("secrets", ("list", OBJECT_REFERENCE)),
                               3: ("imagePullSecrets", ("list", LOCAL_REFERENCE)),
                               4: ("automountServiceAccountToken", "bool")},
    ("authorization.k8s.io/v1", "SelfSubjectAccessReview"): {1: ("metadata", OBJECT_META), 2: ("spec", {
        1: ("resourceAttributes", {1: ("namespace", "str"), 2: ("verb", "str"), 3: ("group", "str"),
                                   4: ("version", "str"), 5: ("resource", "str"), 6: ("subresource", "str"),
                                   7: ("name", "str")}),
        2: ("nonResourceAttributes", {1: ("path", "str"), 2: ("verb", "str")})})},
    ("authorization.k8s.io/v1", "SelfSubjectRulesReview"): {1: ("metadata", OBJECT_META),
                                                            2: ("spec", {1: ("namespace", "str")})},
    ("authentication.k8s.io/v1", "TokenRequest"): {1: ("metadata", OBJECT_META), 2: ("spec", {
        1: ("audiences", "strs"), 4: ("expirationSeconds", "int"), 3: ("boundObjectRef", OBJECT_REFERENCE)})},
}


def _decode(buf: bytes, schema: Schema) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for num, _, value in fields(buf):
        if num not in schema:
            continue
        name, kind = schema[num]
        if kind == "str":
            if value:  # Go's JSON omits empty strings (omitempty); gogo protobuf still encodes them
                out[name] = value.decode()
        elif kind == "bytes":
            out[name] = base64.b64encode(value).decode()
        elif kind == "int":
            if value:
                out[name] = value
        elif kind == "bool":
            out[name] = bool(value)
        elif kind == "strs":
            out.setdefault(name, []).append(value.decode())
        elif kind in ("map", "bmap"):
            entry = {n: v for n, _, v in fields(value)}
            key = entry.get(1, b"").decode()
            raw = entry.get(2, b"")
            out.setdefault(name, {})[key] = raw.decode() if kind == "map" else base64.b64encode(raw).decode()
        elif kind == "time":
            seconds = {n: v for n, _, v in fields(value)}.get(1, 0)
            out[name] = dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        elif isinstance(kind, tuple):
            out.setdefault(name, []).append(_decode(value, kind[1]))
        elif isinstance(kind, dict):
            out[name] = _decode(value, kind)
    return out


def decode_body(body: bytes) -> dict[str, Any]:
    """A protobuf-encoded object -> its JSON dict; ProtobufError names what is not supported."""
    if not body.startswith(MAGIC):
        raise ProtobufError("the body does not start with the Kubernetes protobuf magic 'k8s\\x00'")
    envelope = {n: v for n, _, v in fields(body[len(MAGIC):])}
    type_meta = {n: v.decode() for n, _, v in fields(envelope.get(1, b""))}
    api_version, kind = type_meta.get(1, ""), type_meta.get(2, "")
    schema = KINDS.get((api_version, kind))
    if schema is None:
        raise ProtobufError(
            f"this server decodes protobuf only for {', '.join(k for _, k in KINDS)}; send {kind or 'the object'} "
            "as application/json (kubectl apply -f / kubectl create -f do)"
        )
    obj = _decode(envelope.get(2, b""), schema)
    return {"apiVersion": api_version, "kind": kind, **obj}
