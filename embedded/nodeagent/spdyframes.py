"""SPDY/3.1 framing, the wire format under `kubectl port-forward`: frames to bytes and back.

Owns the frame layouts of draft 3.1 (a control frame: the control bit, version 3, type, 8 bits of flags, 24 bits
of length; a data frame: a 31-bit stream id, flags, length), the name/value header blocks (a 32-bit count, then
length-prefixed lowercase names and values, several values of one name joined by NUL) and their compression:
zlib with the SPDY/3 dictionary, one compression context per direction for the whole session, each block ended
by a sync flush. Frames this module cannot trust (wrong version, a fixed-size frame of the wrong length, stream
id 0, a header block that does not decode) raise FrameError, which says what is wrong; a control frame of a type
it does not know is skipped, as the spec asks. Knows nothing of streams or sockets (spdysession.py does).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

VERSION = 3
SYN_STREAM, SYN_REPLY, RST_STREAM, SETTINGS, PING, GOAWAY, HEADERS, WINDOW_UPDATE = 1, 2, 3, 4, 6, 7, 8, 9
FLAG_FIN = 0x01  # data frames, SYN_STREAM, SYN_REPLY, HEADERS: the sender's last frame on the stream
FLAG_UNIDIRECTIONAL = 0x02  # SYN_STREAM: the receiver may not send on the stream
MAX_LENGTH = (1 << 24) - 1
# RST_STREAM status codes
PROTOCOL_ERROR, INVALID_STREAM, REFUSED_STREAM, UNSUPPORTED_VERSION, CANCEL = 1, 2, 3, 4, 5
INTERNAL_ERROR, FLOW_CONTROL_ERROR, STREAM_IN_USE, STREAM_ALREADY_CLOSED, FRAME_TOO_LARGE = 6, 7, 8, 9, 11
GOAWAY_OK, GOAWAY_PROTOCOL_ERROR, GOAWAY_INTERNAL_ERROR = 0, 1, 2  # GOAWAY status codes

# The SPDY/3 header compression dictionary (draft 3, section 2.6.10.1): these words, each after its 32-bit
# big-endian length, then the tail as it is; 1423 bytes in all.
_DICTIONARY_WORDS = (
    "options head post put delete trace accept accept-charset accept-encoding accept-language accept-ranges age "
    "allow authorization cache-control connection content-base content-encoding content-language content-length "
    "content-location content-md5 content-range content-type date etag expect expires from host if-match "
    "if-modified-since if-none-match if-range if-unmodified-since last-modified location max-forwards pragma "
    "proxy-authenticate proxy-authorization range referer retry-after server te trailer transfer-encoding upgrade "
    "user-agent vary via warning www-authenticate method get status |200 OK| version HTTP/1.1 url public "
    "set-cookie keep-alive origin"
)
_DICTIONARY_TAIL = (
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505"
    "203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request401 Unauthorized"
    "403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented503 Service Unavailable"
    "Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT"
    "chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,"
    "text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0."
)


def _dictionary() -> bytes:
    head, quoted, rest = _DICTIONARY_WORDS.partition("|200 OK|")
    words = [*head.split(), quoted.strip("|"), *rest.split()]
    return b"".join(struct.pack(">I", len(w)) + w.encode() for w in words) + _DICTIONARY_TAIL.encode()


DICTIONARY = _dictionary()

Headers = dict[str, list[str]]  # lowercase name -> its values


class FrameError(ValueError):
    """A frame that breaks SPDY/3.1; `status` is the RST_STREAM / GOAWAY reason to answer with."""

    def __init__(self, message: str, stream_id: int = 0, status: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.stream_id = stream_id
        self.status = status


@dataclass(frozen=True)
class DataFrame:
    stream_id: int
    data: bytes = b""
    flags: int = 0


@dataclass(frozen=True)
class SynStream:
    stream_id: int
    headers: Headers = field(default_factory=dict)
    associated_to: int = 0
    priority: int = 0  # 0 (highest) to 7
    slot: int = 0
    flags: int = 0


@dataclass(frozen=True)
class SynReply:
    stream_id: int
    headers: Headers = field(default_factory=dict)
    flags: int = 0


@dataclass(frozen=True)
class RstStream:
    stream_id: int
    status: int


@dataclass(frozen=True)
class Settings:
    entries: tuple[tuple[int, int, int], ...] = ()  # (flags, id, value)
    flags: int = 0


@dataclass(frozen=True)
class Ping:
    ping_id: int


@dataclass(frozen=True)
class GoAway:
    last_good_stream_id: int
    status: int = 0


@dataclass(frozen=True)
class HeadersFrame:
    stream_id: int
    headers: Headers = field(default_factory=dict)
    flags: int = 0


@dataclass(frozen=True)
class WindowUpdate:
    stream_id: int
    delta: int


Frame = DataFrame | SynStream | SynReply | RstStream | Settings | Ping | GoAway | HeadersFrame | WindowUpdate


def encode_header_block(headers: Headers) -> bytes:
    """The uncompressed name/value block: names lowercased, several values joined by NUL."""
    out = [struct.pack(">I", len(headers))]
    for name, values in headers.items():
        key, value = name.lower().encode(), "\x00".join(values).encode()
        out.append(struct.pack(">I", len(key)) + key + struct.pack(">I", len(value)) + value)
    return b"".join(out)


def decode_header_block(raw: bytes, stream_id: int = 0) -> Headers:
    """The block's names and values; a block that is short, long, or has an uppercase or repeated name is
    refused."""

    def take(at: int, what: str) -> tuple[bytes, int]:
        if at + 4 > len(raw):
            raise FrameError(f"header block ends inside the length of {what}", stream_id)
        (n,) = struct.unpack_from(">I", raw, at)
        if at + 4 + n > len(raw):
            raise FrameError(f"header block ends inside {what} ({n} bytes announced)", stream_id)
        return raw[at + 4 : at + 4 + n], at + 4 + n

    if len(raw) < 4:
        raise FrameError("header block shorter than its pair count", stream_id)
    (count,) = struct.unpack_from(">I", raw, 0)
    at, out = 4, {}
    for i in range(count):
        name_bytes, at = take(at, f"name {i + 1} of {count}")
        value_bytes, at = take(at, f"value {i + 1} of {count}")
        name = name_bytes.decode("utf-8", "replace")
        if not name:
            raise FrameError("header block has an empty name", stream_id)
        if name != name.lower():
            raise FrameError(f"header name {name!r} is not lowercase", stream_id)
        if name in out:
            raise FrameError(f"header name {name!r} appears twice", stream_id)
        out[name] = value_bytes.decode("utf-8", "replace").split("\x00")
    if at != len(raw):
        raise FrameError(f"{len(raw) - at} bytes after the last of {count} header pairs", stream_id)
    return out


class HeaderCompressor:
    """One direction's compression context: every block compressed against everything sent before it."""

    def __init__(self) -> None:
        self._z = zlib.compressobj(level=9, zdict=DICTIONARY)

    def compress(self, headers: Headers) -> bytes:
        return self._z.compress(encode_header_block(headers)) + self._z.flush(zlib.Z_SYNC_FLUSH)


class HeaderDecompressor:
    def __init__(self) -> None:
        self._z = zlib.decompressobj(zdict=DICTIONARY)

    def decompress(self, data: bytes, stream_id: int = 0) -> Headers:
        try:
            raw = self._z.decompress(data)
        except zlib.error as exc:
            raise FrameError(f"header block does not decompress: {exc}", stream_id) from None
        return decode_header_block(raw, stream_id)


def _control(kind: int, flags: int, payload: bytes) -> bytes:
    if len(payload) > MAX_LENGTH:
        raise FrameError(f"control frame of {len(payload)} bytes is too long", status=FRAME_TOO_LARGE)
    return struct.pack(">HHI", 0x8000 | VERSION, kind, (flags << 24) | len(payload)) + payload


class Encoder:
    """Frames to bytes, with this side's header compression context."""

    def __init__(self) -> None:
        self.headers = HeaderCompressor()

    def encode(self, frame: Frame) -> bytes:
        if isinstance(frame, DataFrame):
            if len(frame.data) > MAX_LENGTH:
                raise FrameError(f"data frame of {len(frame.data)} bytes is too long", status=FRAME_TOO_LARGE)
            return struct.pack(">II", frame.stream_id & 0x7FFFFFFF, (frame.flags << 24) | len(frame.data)) + frame.data
        if isinstance(frame, SynStream):
            fixed = struct.pack(">IIBB", frame.stream_id, frame.associated_to, (frame.priority & 7) << 5, frame.slot)
            return _control(SYN_STREAM, frame.flags, fixed + self.headers.compress(frame.headers))
        if isinstance(frame, SynReply):
            return _control(
                SYN_REPLY, frame.flags, struct.pack(">I", frame.stream_id) + self.headers.compress(frame.headers)
            )
        if isinstance(frame, HeadersFrame):
            return _control(
                HEADERS, frame.flags, struct.pack(">I", frame.stream_id) + self.headers.compress(frame.headers)
            )
        if isinstance(frame, RstStream):
            return _control(RST_STREAM, 0, struct.pack(">II", frame.stream_id, frame.status))
        if isinstance(frame, Settings):
            body = b"".join(struct.pack(">II", (f << 24) | i, v) for f, i, v in frame.entries)
            return _control(SETTINGS, frame.flags, struct.pack(">I", len(frame.entries)) + body)
        if isinstance(frame, Ping):
            return _control(PING, 0, struct.pack(">I", frame.ping_id))
        if isinstance(frame, GoAway):
            return _control(GOAWAY, 0, struct.pack(">II", frame.last_good_stream_id, frame.status))
        return _control(WINDOW_UPDATE, 0, struct.pack(">II", frame.stream_id, frame.delta))


class Decoder:
    """Bytes to frames as they come (a frame may arrive in many pieces), with the peer's compression context."""

    def __init__(self) -> None:
        self.headers = HeaderDecompressor()
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        """The frames `data` completes, in order; what is left of a frame waits for the next feed."""
        self._buffer += data
        frames: list[Frame] = []
        while len(self._buffer) >= 8:
            first, second = struct.unpack_from(">II", self._buffer, 0)
            length = second & 0xFFFFFF
            if len(self._buffer) < 8 + length:
                break
            payload = bytes(self._buffer[8 : 8 + length])
            del self._buffer[: 8 + length]
            flags = second >> 24
            if not first & 0x80000000:
                stream_id = first & 0x7FFFFFFF
                if stream_id == 0:
                    raise FrameError("data frame on stream 0")
                frames.append(DataFrame(stream_id, payload, flags))
                continue
            frame = self._control((first >> 16) & 0x7FFF, first & 0xFFFF, flags, payload)
            if frame is not None:
                frames.append(frame)
        return frames

    def _control(self, version: int, kind: int, flags: int, payload: bytes) -> Frame | None:
        if version != VERSION:
            raise FrameError(f"SPDY version {version} is not supported (only 3)", status=UNSUPPORTED_VERSION)
        fixed = {SYN_STREAM: 10, SYN_REPLY: 4, HEADERS: 4, SETTINGS: 4}
        exact = {RST_STREAM: 8, PING: 4, GOAWAY: 8, WINDOW_UPDATE: 8}
        names = {SYN_STREAM: "SYN_STREAM", SYN_REPLY: "SYN_REPLY", HEADERS: "HEADERS", SETTINGS: "SETTINGS"}
        names |= {RST_STREAM: "RST_STREAM", PING: "PING", GOAWAY: "GOAWAY", WINDOW_UPDATE: "WINDOW_UPDATE"}
        if kind in exact and len(payload) != exact[kind]:
            raise FrameError(f"{names[kind]} frame of {len(payload)} bytes (must be {exact[kind]})")
        if kind in fixed and len(payload) < fixed[kind]:
            raise FrameError(f"{names[kind]} frame of {len(payload)} bytes (at least {fixed[kind]})")
        if kind in (SYN_STREAM, SYN_REPLY, HEADERS, RST_STREAM, WINDOW_UPDATE):
            stream_id = struct.unpack_from(">I", payload, 0)[0] & 0x7FFFFFFF
            if stream_id == 0:
                raise FrameError(f"{names[kind]} frame on stream 0")
        if kind == SYN_STREAM:
            associated = struct.unpack_from(">I", payload, 4)[0] & 0x7FFFFFFF
            headers = self.headers.decompress(payload[10:], stream_id)
            return SynStream(stream_id, headers, associated, payload[8] >> 5, payload[9], flags)
        if kind == SYN_REPLY:
            return SynReply(stream_id, self.headers.decompress(payload[4:], stream_id), flags)
        if kind == HEADERS:
            return HeadersFrame(stream_id, self.headers.decompress(payload[4:], stream_id), flags)
        if kind == RST_STREAM:
            status = struct.unpack_from(">I", payload, 4)[0]
            if status == 0:
                raise FrameError(f"RST_STREAM on stream {stream_id} with status 0", stream_id)
            return RstStream(stream_id, status)
        if kind == SETTINGS:
            (count,) = struct.unpack_from(">I", payload, 0)
            if len(payload) != 4 + 8 * count:
                raise FrameError(f"SETTINGS frame of {len(payload)} bytes for {count} entries")
            pairs = [struct.unpack_from(">II", payload, 4 + 8 * i) for i in range(count)]
            return Settings(tuple((fid >> 24, fid & 0xFFFFFF, value) for fid, value in pairs), flags)
        if kind == PING:
            (ping_id,) = struct.unpack_from(">I", payload, 0)
            if ping_id == 0:
                raise FrameError("PING with id 0")
            return Ping(ping_id)
        if kind == GOAWAY:
            last, status = struct.unpack_from(">II", payload, 0)
            return GoAway(last & 0x7FFFFFFF, status)
        if kind == WINDOW_UPDATE:
            delta = struct.unpack_from(">I", payload, 4)[0] & 0x7FFFFFFF
            if delta == 0:
                raise FrameError(f"WINDOW_UPDATE on stream {stream_id} with delta 0", stream_id, FLOW_CONTROL_ERROR)
            return WindowUpdate(stream_id, delta)
        return None  # a type this draft does not define (NOOP, CREDENTIAL, ...): ignored, as the spec asks
