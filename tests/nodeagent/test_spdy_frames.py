"""SPDY/3.1 framing (embedded/nodeagent/spdyframes.py): every frame type round-trips, header blocks are
compressed against the SPDY/3 dictionary over one context per direction, and a broken frame is refused saying
what is wrong."""

from __future__ import annotations

import hashlib
import re
import struct
import zlib

import pytest

from embedded.nodeagent import spdyframes as f

FRAMES: list[f.Frame] = [
    f.DataFrame(1, b"hello"),
    f.DataFrame(3, b"", f.FLAG_FIN),
    f.DataFrame(0x7FFFFFFF, bytes(range(256)) * 300),
    f.SynStream(1, {"streamtype": ["error"], "port": ["8080"], "requestid": ["0"]}, priority=7, slot=2),
    f.SynStream(5, {"multi": ["a", "b"]}, associated_to=3, flags=f.FLAG_FIN | f.FLAG_UNIDIRECTIONAL),
    f.SynReply(1, {}),
    f.SynReply(3, {"status": ["200 OK"]}, f.FLAG_FIN),
    f.RstStream(7, f.CANCEL),
    f.Settings(((0, 7, 65536), (1, 4, 100))),
    f.Settings((), 1),
    f.Ping(1),
    f.GoAway(9, f.GOAWAY_PROTOCOL_ERROR),
    f.HeadersFrame(1, {"x-extra": ["1"]}),
    f.WindowUpdate(1, 4096),
]


def test_the_dictionary_is_the_spdy3_one() -> None:
    assert len(f.DICTIONARY) == 1423
    assert f.DICTIONARY.startswith(b"\x00\x00\x00\x07options\x00\x00\x00\x04head")
    assert f.DICTIONARY.endswith(b"utf-,*,enq=0.")
    assert hashlib.sha256(f.DICTIONARY).hexdigest() == (
        "51d27341373f923f3cd88e1eb7162aeaa3723d7585ff2399201dc06498407f02"
    )


def test_every_frame_type_round_trips() -> None:
    encoder, decoder = f.Encoder(), f.Decoder()
    wire = b"".join(encoder.encode(frame) for frame in FRAMES)
    assert decoder.feed(wire) == FRAMES


def test_frames_split_anywhere_are_put_back_together() -> None:
    """kubectl's framer writes field by field, one WebSocket message each: frames come in pieces."""
    encoder, decoder = f.Encoder(), f.Decoder()
    wire = b"".join(encoder.encode(frame) for frame in FRAMES)
    got: list[f.Frame] = []
    for at in range(0, len(wire), 3):
        got += decoder.feed(wire[at : at + 3])
    assert got == FRAMES


def test_control_and_data_frame_layouts() -> None:
    encoder = f.Encoder()
    assert encoder.encode(f.Ping(5)) == bytes.fromhex("80030006 00000004 00000005")
    assert encoder.encode(f.RstStream(3, f.CANCEL)) == bytes.fromhex("80030003 00000008 00000003 00000005")
    assert encoder.encode(f.DataFrame(3, b"ab", f.FLAG_FIN)) == bytes.fromhex("00000003 01000002") + b"ab"
    assert encoder.encode(f.WindowUpdate(1, 10)) == bytes.fromhex("80030009 00000008 00000001 0000000a")
    assert encoder.encode(f.GoAway(7, 0)) == bytes.fromhex("80030007 00000008 00000007 00000000")
    syn = encoder.encode(f.SynStream(1, {}, priority=3, flags=f.FLAG_FIN))
    assert syn[:4] == bytes.fromhex("80030001") and syn[4] == f.FLAG_FIN
    assert syn[8:18] == bytes.fromhex("00000001 00000000 6000")


def test_header_blocks_are_zlib_with_the_dictionary_over_one_context() -> None:
    encoder = f.Encoder()
    headers = {"streamtype": ["data"], "port": ["80"], "requestid": ["1"]}
    first = encoder.encode(f.SynStream(1, headers))[18:]
    second = encoder.encode(f.SynStream(3, headers))[18:]
    plain = zlib.decompressobj(zdict=f.DICTIONARY)
    expected = f.encode_header_block(headers)
    assert plain.decompress(first) == expected
    assert plain.decompress(second) == expected  # the same context: the repeat costs a few bytes
    assert len(second) < len(first) / 2
    assert first.endswith(b"\x00\x00\xff\xff")  # each block ends with a sync flush
    with pytest.raises(zlib.error):  # without the dictionary the stream cannot be read
        zlib.decompressobj().decompress(first)
    # a block from an independent compressor (as Go's writes) decodes the same way
    go_like = zlib.compressobj(level=9, zdict=f.DICTIONARY)
    block = go_like.compress(expected) + go_like.flush(zlib.Z_SYNC_FLUSH)
    assert f.HeaderDecompressor().decompress(block) == headers


def test_header_names_are_sent_lowercase_and_values_joined_by_nul() -> None:
    raw = f.encode_header_block({"streamType": ["error"], "x": ["a", "b"]})
    assert raw == (
        struct.pack(">I", 2) + struct.pack(">I", 10) + b"streamtype" + struct.pack(">I", 5) + b"error"
        b"\x00\x00\x00\x01x" + struct.pack(">I", 3) + b"a\x00b"
    )
    assert f.decode_header_block(raw) == {"streamtype": ["error"], "x": ["a", "b"]}


def _control(kind: int, payload: bytes, version: int = 3, flags: int = 0) -> bytes:
    return struct.pack(">HHI", 0x8000 | version, kind, (flags << 24) | len(payload)) + payload


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (_control(f.PING, b"\x00\x00\x00\x01", version=2), "SPDY version 2 is not supported"),
        (_control(f.PING, b"\x00\x00\x00\x01\x00"), "PING frame of 5 bytes (must be 4)"),
        (_control(f.PING, b"\x00\x00\x00\x00"), "PING with id 0"),
        (_control(f.RST_STREAM, struct.pack(">II", 1, 0)), "RST_STREAM on stream 1 with status 0"),
        (_control(f.RST_STREAM, struct.pack(">II", 0, 5)), "RST_STREAM frame on stream 0"),
        (_control(f.WINDOW_UPDATE, struct.pack(">II", 1, 0)), "WINDOW_UPDATE on stream 1 with delta 0"),
        (_control(f.SYN_STREAM, b"\x00\x00\x00\x01"), "SYN_STREAM frame of 4 bytes (at least 10)"),
        (_control(f.SETTINGS, struct.pack(">I", 2) + b"\x00" * 8), "SETTINGS frame of 12 bytes for 2 entries"),
        (_control(f.SYN_REPLY, struct.pack(">I", 1) + b"not zlib"), "header block does not decompress"),
        (struct.pack(">II", 0, 1) + b"x", "data frame on stream 0"),
    ],
)
def test_a_broken_frame_is_refused_saying_why(wire: bytes, message: str) -> None:
    with pytest.raises(f.FrameError, match=re.escape(message)):
        f.Decoder().feed(wire)


def test_a_header_block_that_lies_is_refused() -> None:
    compressor = zlib.compressobj(zdict=f.DICTIONARY)

    def reply(block: bytes) -> bytes:
        data = compressor.compress(block) + compressor.flush(zlib.Z_SYNC_FLUSH)
        return _control(f.SYN_REPLY, struct.pack(">I", 1) + data)

    decoder = f.Decoder()
    with pytest.raises(f.FrameError, match="ends inside name 1 of 3"):
        decoder.feed(reply(struct.pack(">I", 3) + struct.pack(">I", 50) + b"port"))
    for block, message in [
        (f.encode_header_block({"a": ["1"]}).replace(b"a", b"A", 1), "header name 'A' is not lowercase"),
        (struct.pack(">I", 2) + f.encode_header_block({"a": ["1"]})[4:] * 2, "header name 'a' appears twice"),
        (f.encode_header_block({}) + b"junk", "4 bytes after the last of 0 header pairs"),
    ]:
        with pytest.raises(f.FrameError, match=re.escape(message)):
            f.decode_header_block(block)


def test_an_unknown_control_frame_type_is_skipped() -> None:
    wire = _control(10, b"credential") + f.Encoder().encode(f.Ping(3))
    assert f.Decoder().feed(wire) == [f.Ping(3)]


def test_a_frame_too_long_to_send_is_refused() -> None:
    with pytest.raises(f.FrameError, match="too long"):
        f.Encoder().encode(f.DataFrame(1, b"\x00" * (f.MAX_LENGTH + 1)))
