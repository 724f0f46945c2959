"""Kubernetes protobuf (`application/vnd.kubernetes.protobuf`), as client-go speaks it, for every
built-in kind the server serves: request bodies decoded into the JSON shape, responses and watch
streams encoded from it. Custom resources (CRDs) stay JSON-only, as upstream.

The schema is protoschema/table.py, generated from upstream's generated.proto and types.go
(protoschema/generate.py): per message, field number -> JSON name, label, type. The codec walks
it both ways; the apimachinery types whose JSON is not an object are converted here: Time
(RFC 3339, seconds), MicroTime (microseconds), Duration (Go's "1h2m3s"), Quantity (its string),
IntOrString (number or string), RawExtension and FieldsV1 (raw JSON). Fields a message does not
know are dropped, as upstream drops unknown protobuf fields. Zero scalars a Go client always
writes (gogo protobuf encodes every non-pointer field) are left out of the JSON where Go's JSON
would omit them (`omitempty` on a non-pointer), so a client-go body reads as its JSON would.

Envelope (apimachinery runtime/serializer/protobuf): the 4-byte magic `k8s\\x00`, then a
runtime.Unknown {typeMeta {apiVersion, kind}, raw (the object's message), contentEncoding,
contentType}. Watch streams (the "raw" stream serializer and LengthDelimitedFramer): each frame is
a 4-byte big-endian length and a meta.v1.WatchEvent {type, object: RawExtension} with no magic;
the RawExtension's raw is the object in the full envelope (magic included).
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import re
import struct
from typing import Any

import msgspec

from embedded.apiserver import wire
from embedded.apiserver.protoschema.table import KINDS, MESSAGES, NULLABLE
from shared.logs import get_logger

log = get_logger(__name__)

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
WATCH_MEDIA_TYPE = MEDIA_TYPE + ";stream=watch"
MAGIC = b"k8s\x00"
# Kinds registered in every group version (client-go sends DeleteOptions as e.g. resource.k8s.io/v1).
_ANY_VERSION = {"DeleteOptions": "apis.meta.v1.DeleteOptions", "Status": "apis.meta.v1.Status"}
_JSON_LIKE = ("application/json", "application/yaml", "*/*", "application/*")


class ProtobufError(ValueError):
    pass


# ---- content negotiation


def _accepted(accept: str) -> list[tuple[str, dict[str, str]]]:
    """The Accept header's media types, most preferred first (q-values, then the client's order)."""
    out = []
    for i, part in enumerate(accept.split(",")):
        media, *raw_params = [p.strip() for p in part.split(";")]
        if not media:
            continue
        params = dict(p.partition("=")[::2] for p in raw_params if "=" in p)
        try:
            q = float(params.pop("q", "1"))
        except ValueError:
            q = 1.0
        if q > 0:
            out.append((q, i, media.lower(), params))
    out.sort(key=lambda e: (-e[0], e[1]))
    return [(media, params) for _, _, media, params in out]


METADATA_KINDS = ("PartialObjectMetadata", "PartialObjectMetadataList")


@functools.lru_cache(maxsize=256)  # clients send the same few Accept headers on every request
def prefers_protobuf(accept: str, as_kinds: tuple[str, ...] = ()) -> bool:
    """Whether the client's first acceptable media type is protobuf: plain, or `as=` one of `as_kinds`
    (client-go's metadata client asks `;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1`; a Table
    has no protobuf form)."""
    for media, params in _accepted(accept):
        if media == MEDIA_TYPE:
            return "as" not in params or params["as"] in as_kinds
        if media in _JSON_LIKE:
            return False
    return False


@functools.lru_cache(maxsize=256)
def accepts_json(accept: str) -> bool:
    """Whether a JSON answer is acceptable (no Accept header means anything is)."""
    accepted = _accepted(accept)
    return not accepted or any(media in _JSON_LIKE for media, _ in accepted)


def kind_message(api_version: str, kind: str) -> str | None:
    return KINDS.get((api_version, kind))


# ---- scalars and the apimachinery types

_SCALAR_WIRE = {
    "string": wire.BYTES,
    "bytes": wire.BYTES,
    "bool": wire.VARINT,
    "int32": wire.VARINT,
    "int64": wire.VARINT,
    "uint32": wire.VARINT,
    "uint64": wire.VARINT,
    "double": wire.FIXED64,
    "float": wire.FIXED32,
}
_TIME = "apis.meta.v1.Time"
_MICROTIME = "apis.meta.v1.MicroTime"
_DURATION = "apis.meta.v1.Duration"
_QUANTITY = "api.resource.Quantity"
_INTORSTRING = "util.intstr.IntOrString"
_RAW = ("runtime.RawExtension", "apis.meta.v1.FieldsV1")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _parse_time(text: str) -> tuple[int, int]:
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ProtobufError(f"{text!r} is not an RFC 3339 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    delta = when - _EPOCH
    seconds = delta.days * 86400 + delta.seconds
    return seconds, delta.microseconds * 1000


def _format_time(seconds: int, nanos: int, micro: bool) -> str:
    when = _EPOCH + dt.timedelta(seconds=seconds, microseconds=nanos // 1000)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)", re.ASCII)
_UNIT_NS = {"ns": 1, "us": 1000, "µs": 1000, "ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}


def _parse_duration(text: str) -> int:
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
    if body == "0":
        return 0
    parts = _DURATION_PART.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ProtobufError(f"{text!r} is not a Go duration (like 1h2m3s)")
    return sign * round(sum(float(n) * _UNIT_NS[u] for n, u in parts))


def _format_duration(ns: int) -> str:
    """Go's time.Duration.String()."""
    if ns == 0:
        return "0s"
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    if ns < 10**9:
        for unit, size in (("ms", 10**6), ("µs", 1000), ("ns", 1)):
            if ns >= size:
                return sign + _trim(ns / size) + unit
    hours, rest = divmod(ns, 3600 * 10**9)
    minutes, rest = divmod(rest, 60 * 10**9)
    out = f"{hours}h" if hours else ""
    out += f"{minutes}m" if hours or minutes else ""
    return sign + out + _trim(rest / 10**9) + "s"


def _trim(value: float) -> str:
    return f"{value:.9f}".rstrip("0").rstrip(".")


def _special_to_json(type_: str, buf: bytes) -> Any:
    fs = {num: value for num, _, value in wire.fields(buf)}
    if type_ in (_TIME, _MICROTIME):
        seconds, nanos = wire.signed(fs.get(1, 0)), wire.signed(fs.get(2, 0), 32)
        return None if seconds == nanos == 0 else _format_time(seconds, nanos, type_ == _MICROTIME)
    if type_ == _QUANTITY:
        return _text(fs.get(1, b""))
    if type_ == _INTORSTRING:
        return _text(fs.get(3, b"")) if fs.get(1, 0) == 1 else wire.signed(fs.get(2, 0), 32)
    if type_ == _DURATION:
        return _format_duration(wire.signed(fs.get(1, 0)))
    raw = fs.get(1, b"")  # RawExtension, FieldsV1: JSON bytes
    if not raw:
        return None
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise ProtobufError("a RawExtension/FieldsV1 holds bytes that are not JSON") from None


def _special_from_json(type_: str, value: Any) -> bytes:
    if type_ in (_TIME, _MICROTIME):
        seconds, nanos = _parse_time(value)
        return wire.int_field(1, seconds) + (wire.int_field(2, nanos) if type_ == _MICROTIME else b"")
    if type_ == _QUANTITY:
        return wire.bytes_field(1, str(value).encode())
    if type_ == _INTORSTRING:
        if isinstance(value, str):
            return wire.int_field(1, 1) + wire.int_field(2, 0) + wire.bytes_field(3, value.encode())
        return wire.int_field(1, 0) + wire.int_field(2, int(value)) + wire.bytes_field(3, b"")
    if type_ == _DURATION:
        return wire.int_field(1, _parse_duration(value))
    return wire.bytes_field(1, msgspec.json.encode(value))


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ProtobufError("a string field holds bytes that are not UTF-8") from None


def _scalar_to_json(type_: str, wire_type: int, value: Any) -> Any:
    if type_ == "string":
        return _text(value)
    if type_ == "bytes":
        return base64.b64encode(value).decode()
    if type_ == "bool":
        return bool(value)
    if type_ in ("int32", "int64"):
        return wire.signed(value, 32 if type_ == "int32" else 64)
    if type_ in ("uint32", "uint64"):
        return value
    if type_ == "double":
        return struct.unpack("<d", value)[0]
    return struct.unpack("<f", value)[0]


def _scalar_from_json(num: int, type_: str, value: Any) -> bytes:
    if type_ == "string":
        if not isinstance(value, str):
            raise ProtobufError(f"expected a string, got {value!r}")
        return wire.bytes_field(num, value.encode())
    if type_ == "bytes":
        return wire.bytes_field(num, base64.b64decode(value))
    if type_ == "bool":
        return wire.key(num, wire.VARINT) + (b"\x01" if value else b"\x00")
    if type_ in ("int32", "int64", "uint32", "uint64"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtobufError(f"expected an integer, got {value!r}")
        return wire.int_field(num, int(value))
    if type_ == "double":
        return wire.double_field(num, value)
    return wire.float_field(num, value)


def _zero(value: Any) -> bool:
    return value == "" or value == 0 or value is False


# ---- messages


def to_json(buf: bytes, message: str) -> dict[str, Any]:
    """A message's bytes -> its JSON object (ProtobufError or wire.WireError when malformed)."""
    out: dict[str, Any] = {}
    _into(out, buf, message)
    return out


def _into(out: dict[str, Any], buf: bytes, message: str) -> None:
    schema = MESSAGES[message]
    for num, wire_type, value in wire.fields(buf):
        spec = schema.get(num)
        if spec is None:
            continue  # unknown fields are dropped, as upstream does
        name, label, type_ = spec[0], spec[1], spec[2]
        if label == "map":
            entry = {n: v for n, w, v in wire.fields(_bytes_of(value, wire_type, message, name))}
            key = _text(entry.get(1, b"")) if spec[2] == "string" else entry.get(1, 0)
            out.setdefault(name, {})[key] = _value_to_json(spec[3], wire.BYTES, entry.get(2, b""))
            continue
        if label == "inline":
            _into(out, _bytes_of(value, wire_type, message, name), type_)
            continue
        if label == "*" and type_ in _SCALAR_WIRE and type_ not in ("string", "bytes") and wire_type == wire.BYTES:
            out.setdefault(name, []).extend(_unpack(type_, value))  # a packed repeated scalar
            continue
        if (type_ in _SCALAR_WIRE and wire_type != _SCALAR_WIRE[type_]) or (
            type_ not in _SCALAR_WIRE and wire_type != wire.BYTES
        ):
            raise ProtobufError(f"{message}.{name} (field {num}): wire type {wire_type} does not fit type {type_}")
        converted = _value_to_json(type_, wire_type, value)
        if label == "*":
            out.setdefault(name, []).append(converted)
        elif converted is None or (not spec[3] and _zero(converted) and type_ in _SCALAR_WIRE):
            out.pop(name, None)
        else:
            out[name] = converted


def _bytes_of(value: Any, wire_type: int, message: str, name: str) -> bytes:
    if wire_type != wire.BYTES:
        raise ProtobufError(f"{message}.{name}: expected a length-delimited field, got wire type {wire_type}")
    return value  # type: ignore[no-any-return]


def _unpack(type_: str, buf: bytes) -> list[Any]:
    if type_ in ("double", "float"):
        width, fmt = (8, "<d") if type_ == "double" else (4, "<f")
        if len(buf) % width:
            raise ProtobufError("a packed repeated field is truncated")
        return [struct.unpack(fmt, buf[i : i + width])[0] for i in range(0, len(buf), width)]
    out, pos = [], 0
    while pos < len(buf):
        value, pos = wire.read_varint(buf, pos)
        out.append(_scalar_to_json(type_, wire.VARINT, value))
    return out


def _value_to_json(type_: str, wire_type: int, value: Any) -> Any:
    if type_ in _SCALAR_WIRE:
        return _scalar_to_json(type_, wire_type, value)
    if type_ in MESSAGES:
        if type_ in NULLABLE:
            return to_json(value, type_).get("items", [])
        return to_json(value, type_)
    return _special_to_json(type_, value)


def _index(message: str) -> tuple[dict[str, tuple[int, tuple[Any, ...]]], list[tuple[int, str]]]:
    """The message's fields by JSON name, and its inlined (embedded) messages."""
    found = _INDEX.get(message)
    if found is None:
        schema = MESSAGES[message]
        by_name = {spec[0]: (num, spec) for num, spec in schema.items() if spec[1] != "inline"}
        inlines = [(num, spec[2]) for num, spec in schema.items() if spec[1] == "inline"]
        found = _INDEX[message] = (by_name, inlines)
    return found


_INDEX: dict[str, tuple[dict[str, tuple[int, tuple[Any, ...]]], list[tuple[int, str]]]] = {}


def from_json(obj: dict[str, Any], message: str, lenient: bool = False) -> bytes:
    """A JSON object -> the message's bytes; fields the message does not know are left out. A value
    that does not fit its field raises ProtobufError, or with `lenient` is left out (and logged)."""
    if not isinstance(obj, dict):
        raise ProtobufError(f"{message}: expected an object, got {type(obj).__name__}")
    by_name, inlines = _index(message)
    out = []
    for num, type_ in inlines:
        inner = from_json(obj, type_, lenient)
        if inner:
            out.append(wire.bytes_field(num, inner))
    for name, value in obj.items():
        found = by_name.get(name)
        if found is None or value is None:
            continue
        num, spec = found
        label, type_ = spec[1], spec[2]
        try:
            if label == "map":
                for k, v in value.items():
                    if v is not None:
                        entry = _scalar_from_json(1, type_, k) + _value_from_json(2, spec[3], v, lenient)
                        out.append(wire.bytes_field(num, entry))
            elif label == "*":
                out += [_value_from_json(num, type_, item, lenient) for item in value if item is not None]
            else:
                out.append(_value_from_json(num, type_, value, lenient))
        except (ProtobufError, TypeError, ValueError, AttributeError) as exc:
            if not lenient:
                raise ProtobufError(f"{message}.{name}: {exc}") from None
            log.warning(
                "a field left out of a protobuf message: its value does not fit",
                field=f"{message}.{name}",
                error=str(exc),
            )
    return b"".join(out)


def _value_from_json(num: int, type_: str, value: Any, lenient: bool = False) -> bytes:
    if type_ in _SCALAR_WIRE:
        return _scalar_from_json(num, type_, value)
    if type_ in NULLABLE:
        return wire.bytes_field(num, from_json({"items": value}, type_, lenient))
    if type_ in MESSAGES:
        return wire.bytes_field(num, from_json(value, type_, lenient))
    return wire.bytes_field(num, _special_from_json(type_, value))


# ---- the envelope, objects, watch frames


def envelope(api_version: str, kind: str, raw: bytes) -> bytes:
    type_meta = wire.bytes_field(1, api_version.encode()) + wire.bytes_field(2, kind.encode())
    return (
        MAGIC
        + wire.bytes_field(1, type_meta)
        + wire.bytes_field(2, raw)
        + wire.bytes_field(3, b"")
        + wire.bytes_field(4, b"")
    )


def can_encode(obj: Any) -> bool:
    return isinstance(obj, dict) and (obj.get("apiVersion", ""), obj.get("kind", "")) in KINDS


def encode_object(obj: dict[str, Any], lenient: bool = False) -> bytes:
    """An object of a built-in kind (apiVersion and kind set) -> magic + runtime.Unknown."""
    api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    message = KINDS.get((api_version, kind))
    if message is None:
        raise ProtobufError(f"{kind or 'this object'} ({api_version}) has no protobuf form")
    return envelope(api_version, kind, from_json(obj, message, lenient))


def encode_list(api_version: str, kind: str, list_meta: dict[str, Any], items_raw: list[bytes]) -> bytes:
    """A List from its metadata and the items' already encoded messages (no envelope each)."""
    meta = from_json(list_meta, "apis.meta.v1.ListMeta")
    body = wire.bytes_field(1, meta) + b"".join(wire.bytes_field(2, raw) for raw in items_raw)
    return envelope(api_version, kind, body)


def object_message(obj: dict[str, Any]) -> bytes:
    """The object's message without the envelope (what a List's items hold)."""
    message = KINDS.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if message is None:
        raise ProtobufError(f"{obj.get('kind')} ({obj.get('apiVersion')}) has no protobuf form")
    return from_json(obj, message)


def watch_frame(event_type: str, obj: dict[str, Any]) -> bytes:
    """One frame of a protobuf watch stream (a stream cannot turn to JSON: a value that does not fit
    its field is left out of the frame, and logged)."""
    raw = encode_object(obj, lenient=True)
    event = wire.bytes_field(1, event_type.encode()) + wire.bytes_field(2, wire.bytes_field(1, raw))
    return struct.pack(">I", len(event)) + event


def decode_body(body: bytes, default: tuple[str, str] = ("", "")) -> dict[str, Any]:
    """A protobuf request body -> its JSON object. `default` is the (apiVersion, kind) the URL
    implies, used where the envelope leaves them out (as upstream defaults them). ProtobufError
    says what is wrong."""
    if not body.startswith(MAGIC):
        raise ProtobufError("the body does not start with the Kubernetes protobuf magic 'k8s\\x00'")
    if len(body) == len(MAGIC):
        raise ProtobufError("the protobuf body is empty after its magic")
    try:
        env = {num: value for num, _, value in wire.fields(body[len(MAGIC) :])}
        type_meta = {num: value for num, _, value in wire.fields(env.get(1, b""))}
        api_version = _text(type_meta.get(1, b"")) or default[0]
        kind = _text(type_meta.get(2, b"")) or default[1]
        message = KINDS.get((api_version, kind)) or _ANY_VERSION.get(kind)
        if message is None:
            raise UnknownKind(
                f"{kind or 'an object with no kind'} ({api_version or 'no apiVersion'}) is not "
                "a kind this server reads as protobuf; send it as application/json"
            )
        if env.get(3):
            raise ProtobufError(f"contentEncoding {_text(env[3])!r} is not supported")
        obj = to_json(env.get(2, b""), message)
    except wire.WireError as exc:
        raise ProtobufError(f"the protobuf body is malformed: {exc}") from None
    return {"apiVersion": api_version, "kind": kind, **obj}


class UnknownKind(ProtobufError):
    """The envelope names a kind with no protobuf form here (a custom resource, say)."""
