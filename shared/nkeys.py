"""NATS NKEYs: Ed25519 key pairs in NATS' text encoding, for decentralized (JWT) authentication.

Owns the key arithmetic and encoding only: a seed text (`SO...`, `SA...`, `SU...`) holds the 32-byte
Ed25519 seed of an operator, account or user; its public key text (`O...`, `A...`, `U...`) is what
JWTs name; `sign` makes the Ed25519 signatures that JWTs and the server's connect nonce need.

Facts carried over from NATS: base32 without padding of [prefix byte(s), key, CRC-16/XMODEM
little-endian]; the seed's two prefix bytes put the seed prefix (18<<3, "S") and the key type
(operator 14<<3, account 0, user 20<<3) into 5-bit groups. Ed25519 is RFC 8032 (SHA-512, the
edwards25519 base point), written out here because the runtime has no Ed25519 library; it is not
constant-time, which matters little for a key that signs a few nonces in its own process, and the
tests check it against RFC 8032's vectors and a real nats-server.
"""

from __future__ import annotations

import base64
import hashlib
import os
from typing import Literal

KeyKind = Literal["operator", "account", "user"]

_PREFIX: dict[str, int] = {"operator": 14 << 3, "account": 0, "user": 20 << 3}
_SEED_PREFIX = 18 << 3

_P = 2**255 - 19
_L = 2**252 + 27742317777372353535851937790883648493
_D = -121665 * pow(121666, _P - 2, _P) % _P
_BX = 15112221349535400772501151409588531511454012693041857206046113283949847762202
_BY = 46316835694926478169428394003475163141307993866256225615783033603165251855960
_Point = tuple[int, int, int, int]  # extended coordinates (X, Y, Z, T)
_BASE: _Point = (_BX, _BY, 1, _BX * _BY % _P)


class NKeyError(ValueError):
    """A key text is malformed, has a bad checksum, or is not the kind that was expected."""


def _add(p: _Point, q: _Point) -> _Point:
    a = (p[1] - p[0]) * (q[1] - q[0]) % _P
    b = (p[1] + p[0]) * (q[1] + q[0]) % _P
    c = 2 * p[3] * q[3] * _D % _P
    d = 2 * p[2] * q[2] % _P
    e, f, g, h = b - a, d - c, d + c, b + a
    return (e * f % _P, g * h % _P, f * g % _P, e * h % _P)


def _multiply(scalar: int, point: _Point) -> _Point:
    result: _Point = (0, 1, 1, 0)
    while scalar:
        if scalar & 1:
            result = _add(result, point)
        point = _add(point, point)
        scalar >>= 1
    return result


def _compress(point: _Point) -> bytes:
    z_inv = pow(point[2], _P - 2, _P)
    x, y = point[0] * z_inv % _P, point[1] * z_inv % _P
    return (y | ((x & 1) << 255)).to_bytes(32, "little")


def _expand(seed: bytes) -> tuple[int, bytes]:
    digest = hashlib.sha512(seed).digest()
    scalar = int.from_bytes(digest[:32], "little")
    scalar &= (1 << 254) - 8
    scalar |= 1 << 254
    return scalar, digest[32:]


def ed25519_public(seed: bytes) -> bytes:
    """The 32-byte Ed25519 public key of a 32-byte seed (RFC 8032 5.1.5)."""
    scalar, _ = _expand(seed)
    return _compress(_multiply(scalar, _BASE))


def ed25519_sign(seed: bytes, message: bytes) -> bytes:
    """The 64-byte Ed25519 signature of `message` (RFC 8032 5.1.6)."""
    scalar, prefix = _expand(seed)
    public = _compress(_multiply(scalar, _BASE))
    r = int.from_bytes(hashlib.sha512(prefix + message).digest(), "little") % _L
    r_point = _compress(_multiply(r, _BASE))
    h = int.from_bytes(hashlib.sha512(r_point + public + message).digest(), "little") % _L
    return r_point + ((r + h * scalar) % _L).to_bytes(32, "little")


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def _encode(payload: bytes) -> str:
    return base64.b32encode(payload + _crc16(payload).to_bytes(2, "little")).decode().rstrip("=")


def _decode(text: str) -> bytes:
    clean = text.strip()
    try:
        raw = base64.b32decode(clean + "=" * (-len(clean) % 8))
    except ValueError as exc:
        raise NKeyError(f"not an NKEY (base32): {exc}") from None
    if len(raw) < 4 or _crc16(raw[:-2]) != int.from_bytes(raw[-2:], "little"):
        raise NKeyError("NKEY checksum mismatch: the key text is damaged or truncated")
    return raw[:-2]


class KeyPair:
    """An operator, account or user NKEY (seed and public key)."""

    def __init__(self, kind: KeyKind, seed: bytes) -> None:
        if len(seed) != 32:
            raise NKeyError(f"an Ed25519 seed is 32 bytes, not {len(seed)}")
        self.kind: KeyKind = kind
        self._seed = seed
        self.public_key = _encode(bytes([_PREFIX[kind]]) + ed25519_public(seed))

    @classmethod
    def create(cls, kind: KeyKind) -> KeyPair:
        return cls(kind, os.urandom(32))

    @classmethod
    def from_seed(cls, text: str, kind: KeyKind | None = None) -> KeyPair:
        """Parse a seed text (`S` + type letter + ...); `kind` checks which type it must be."""
        raw = _decode(text)
        if len(raw) != 34 or raw[0] & 0xF8 != _SEED_PREFIX:
            raise NKeyError("not an NKEY seed (it must start with 'S' and decode to 34 bytes)")
        prefix = ((raw[0] & 0x07) << 5) | ((raw[1] & 0xF8) >> 3)
        found = next((k for k, v in _PREFIX.items() if v == prefix), None)
        if found is None:
            raise NKeyError("an NKEY seed of an unknown type (operator, account and user are known)")
        if kind is not None and found != kind:
            raise NKeyError(f"expected a {kind} seed, got a {found} seed")
        return cls(found, raw[2:])  # type: ignore[arg-type]

    @property
    def seed(self) -> str:
        prefix = _PREFIX[self.kind]
        return _encode(bytes([_SEED_PREFIX | (prefix >> 5), (prefix & 0x1F) << 3]) + self._seed)

    def sign(self, message: bytes) -> bytes:
        return ed25519_sign(self._seed, message)
