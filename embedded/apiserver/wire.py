"""The protobuf wire format, both ways: varints, field keys, length-delimited and fixed-width
fields (writing), and a message split into its fields (reading). Schemas live with their users:
protobuf.py (the Kubernetes kinds) and openapi_proto.py (the OpenAPI v2 document)."""

from __future__ import annotations

import functools
import struct
from typing import Any

VARINT, FIXED64, BYTES, FIXED32 = 0, 1, 2, 5
_MASK64 = (1 << 64) - 1


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message (truncated, or a wire type not in proto2)."""


_ONE_BYTE = [bytes((i,)) for i in range(128)]


def varint(value: int) -> bytes:
    """A varint; negative values as 64-bit two's complement (ten bytes), as int32/int64 are written."""
    if 0 <= value < 128:
        return _ONE_BYTE[value]
    out = bytearray()
    value &= _MASK64
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


@functools.cache
def key(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def bytes_field(field: int, data: bytes) -> bytes:
    n = len(data)
    return key(field, BYTES) + (_ONE_BYTE[n] if n < 128 else varint(n)) + data


def str_field(field: int, text: str) -> bytes:
    """A string field, left out when empty (for writers whose schema treats "" as unset)."""
    return bytes_field(field, text.encode()) if text else b""


def int_field(field: int, value: int) -> bytes:
    return key(field, VARINT) + varint(int(value))


def bool_field(field: int, value: bool) -> bytes:
    return key(field, VARINT) + b"\x01" if value else b""


def double_field(field: int, value: float) -> bytes:
    return key(field, FIXED64) + struct.pack("<d", float(value))


def float_field(field: int, value: float) -> bytes:
    return key(field, FIXED32) + struct.pack("<f", float(value))


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(buf):
            raise WireError(f"truncated varint at byte {pos}")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift >= 70:
            raise WireError(f"varint longer than ten bytes at byte {pos}")


def signed(value: int, bits: int = 64) -> int:
    """A varint read back as a two's complement int32/int64."""
    value &= (1 << bits) - 1 if bits == 32 else _MASK64
    return value - (1 << bits) if value >> (bits - 1) else value


def fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) for each field: an int for varints, bytes otherwise.
    WireError says where the message is truncated or malformed."""
    out: list[tuple[int, int, Any]] = []
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = read_varint(buf, pos)
        num, wire = tag >> 3, tag & 7
        if num == 0:
            raise WireError(f"field number 0 at byte {pos}")
        value: Any
        if wire == VARINT:
            value, pos = read_varint(buf, pos)
        elif wire == BYTES:
            length, pos = read_varint(buf, pos)
            if pos + length > end:
                raise WireError(f"field {num}: {length} bytes announced at byte {pos}, only {end - pos} left")
            value, pos = buf[pos : pos + length], pos + length
        elif wire in (FIXED64, FIXED32):
            width = 8 if wire == FIXED64 else 4
            if pos + width > end:
                raise WireError(f"field {num}: truncated fixed-width value at byte {pos}")
            value, pos = buf[pos : pos + width], pos + width
        else:
            raise WireError(f"field {num}: wire type {wire} is not supported (groups are not proto3/k8s)")
        out.append((num, wire, value))
    return out
