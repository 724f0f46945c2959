"""NATS decentralized authentication: operator, account and user JWTs, .creds files, the server
block that trusts them, and the client side that signs a server's nonce.

Owns the JWT v2 facts: a JWT is base64url(header).base64url(claims).base64url(signature) with header
{"typ": "JWT", "alg": "ed25519-nkey"}, signed with the issuer's NKEY (shared.nkeys); `iss` is the
issuer's public key and `sub` the subject's; `jti` is base32 of SHA-512/256 of the claims with an
empty jti; `nats.type` is operator, account or user, `nats.version` 2. The operator signs itself and
the accounts; an account signs its users, whose JWT carries the user's publish/subscribe permissions
(`pub`, `sub`, `resp`). The server trusts the operator JWT and reads account JWTs from a MEMORY
resolver preloaded in its config; a client presents its user JWT and signs the connect nonce with
the user seed (both from a .creds file).

Auth callout (nats-server 2.10+): an account whose JWT has `authorization.auth_users` hands every
other user's connect to a service: the server publishes an `authorization_request` JWT (signed by
the server's key, `aud` "nats-authorization-request", `nats.user_nkey` the key the answer must
name, `nats.server_id.id` the server, `nats.connect_opts.auth_token` what the client sent) on
`$SYS.REQ.USER.AUTH`; the service replies with an `authorization_response` JWT (`sub` the user
nkey, `aud` the server id, `nats.jwt` a user JWT or `nats.error`), signed by the callout account
or one of its signing keys (then `nats.issuer_account` names it). The user JWT inside is issued by
an account in `authorization.allowed_accounts` (or its signing key, with `issuer_account`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from shared.nkeys import KeyPair, NKeyError

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_JWT_BEGIN = "-----BEGIN NATS USER JWT-----"
_JWT_END = "------END NATS USER JWT------"
_SEED_BEGIN = "-----BEGIN USER NKEY SEED-----"
_SEED_END = "------END USER NKEY SEED------"
UNLIMITED = -1


class CredsError(ValueError):
    """A .creds file or JWT is malformed; the message says what and how to get a new one."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode(claims: Mapping[str, Any], issuer: KeyPair, *, issued_at: int | None = None) -> str:
    """A signed JWT of `claims` (which must hold `sub`, `name` and `nats`), issued by `issuer`."""
    body: dict[str, Any] = {
        **claims,
        "iat": issued_at if issued_at is not None else int(time.time()),
        "iss": issuer.public_key,
        "jti": "",
    }
    digest = hashlib.new("sha512_256", json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    signing_input = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(body, sort_keys=True).encode())}"
    return f"{signing_input}.{_b64(issuer.sign(signing_input.encode()))}"


def decode_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT (not verified: the server verifies; this is for reading names back)."""
    try:
        _, claims, _ = token.split(".")
        value = json.loads(_unb64(claims))
    except ValueError as exc:
        raise CredsError(f"not a NATS JWT: {exc}") from None
    if not isinstance(value, dict):
        raise CredsError("not a NATS JWT: its claims are not an object")
    return value


def operator_jwt(operator: KeyPair, name: str, system_account: str) -> str:
    return encode(
        {
            "sub": operator.public_key,
            "name": name,
            "nats": {"type": "operator", "version": 2, "system_account": system_account},
        },
        operator,
    )


def account_jwt(
    operator: KeyPair,
    account: KeyPair,
    name: str,
    *,
    jetstream: bool,
    revocations: Mapping[str, int] | None = None,
    signing_keys: list[str] | None = None,
    auth_users: list[str] | None = None,
    allowed_accounts: list[str] | None = None,
) -> str:
    """An account with no connection limits; JetStream enabled (unlimited storage) when asked.
    `signing_keys` may issue its users; `auth_users` turns on auth callout for every other user of
    it, answered by those users, who may place users into `allowed_accounts`."""
    limits: dict[str, Any] = {
        "subs": UNLIMITED,
        "data": UNLIMITED,
        "payload": UNLIMITED,
        "imports": UNLIMITED,
        "exports": UNLIMITED,
        "wildcards": True,
        "conn": UNLIMITED,
        "leaf": UNLIMITED,
    }
    if jetstream:
        limits |= {"mem_storage": UNLIMITED, "disk_storage": UNLIMITED, "streams": UNLIMITED, "consumer": UNLIMITED}
    nats: dict[str, Any] = {
        "type": "account",
        "version": 2,
        "limits": limits,
        "default_permissions": {"pub": {}, "sub": {}},
    }
    if revocations:
        nats["revocations"] = dict(revocations)
    if signing_keys:
        nats["signing_keys"] = list(signing_keys)
    if auth_users:
        nats["authorization"] = {"auth_users": list(auth_users), "allowed_accounts": list(allowed_accounts or [])}
    return encode({"sub": account.public_key, "name": name, "nats": nats}, operator)


def user_jwt(
    account: KeyPair,
    user: KeyPair | str,
    name: str,
    *,
    publish: list[str],
    subscribe: list[str],
    allow_responses: bool,
    deny_publish: list[str] | None = None,
    issuer_account: str = "",
    expires: int | None = None,
    bearer: bool = False,
) -> str:
    """A user of `account` whose permissions are baked into its JWT. `user` is its key (or public
    key); `issuer_account` names the account when `account` is one of its signing keys; `expires`
    (Unix seconds) ends the connection then; `bearer` lets it connect without signing the nonce.
    Empty allow lists deny everything (NATS reads a permission with no allow as no limit); `deny_publish`
    carves subjects out of `publish` (a deny wins over an allow)."""
    pub: dict[str, list[str]] = {"allow": publish} if publish else {"deny": [">"]}
    if publish and deny_publish:
        pub["deny"] = deny_publish
    nats: dict[str, Any] = {
        "type": "user",
        "version": 2,
        "pub": pub,
        "sub": {"allow": subscribe} if subscribe else {"deny": [">"]},
        "subs": UNLIMITED,
        "data": UNLIMITED,
        "payload": UNLIMITED,
    }
    if allow_responses:
        nats["resp"] = {"max": 1, "ttl": 60_000_000_000}  # one reply within a minute (nanoseconds)
    if issuer_account:
        nats["issuer_account"] = issuer_account
    if bearer:
        nats["bearer_token"] = True
    claims: dict[str, Any] = {"sub": user if isinstance(user, str) else user.public_key, "name": name, "nats": nats}
    if expires is not None:
        claims["exp"] = expires
    return encode(claims, account)


def authorization_response(
    issuer: KeyPair, issuer_account: str, user_nkey: str, server_id: str, *, user_jwt: str = "", error: str = ""
) -> str:
    """The auth callout's answer to one request: the user's JWT, or the reason it is refused."""
    nats: dict[str, Any] = {"type": "authorization_response", "version": 2}
    nats |= {"jwt": user_jwt} if user_jwt else {"error": error or "not authorized"}
    if issuer_account and issuer_account != issuer.public_key:
        nats["issuer_account"] = issuer_account
    return encode({"sub": user_nkey, "aud": server_id, "nats": nats}, issuer)


def creds_file(jwt: str, user: KeyPair) -> str:
    """The .creds text nats clients read: the user JWT and the user's NKEY seed."""
    return (
        f"{_JWT_BEGIN}\n{jwt}\n{_JWT_END}\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        f"{_SEED_BEGIN}\n{user.seed}\n{_SEED_END}\n\n"
        "*************************************************************\n"
    )


def _block(text: str, begin: str, end: str) -> str:
    lines = [line.strip() for line in text.splitlines()]
    try:
        start = lines.index(begin)
        stop = lines.index(end, start)
    except ValueError:
        raise CredsError(f"no {begin!r} ... {end!r} block") from None
    inner = [line for line in lines[start + 1 : stop] if line]
    if len(inner) != 1:
        raise CredsError(f"the {begin!r} block must hold exactly one line")
    return inner[0]


class Creds:
    """A parsed .creds file: the user JWT and the key that signs the server's nonce."""

    def __init__(self, text: str) -> None:
        self.jwt = _block(text, _JWT_BEGIN, _JWT_END)
        try:
            self.key = KeyPair.from_seed(_block(text, _SEED_BEGIN, _SEED_END), "user")
        except NKeyError as exc:
            raise CredsError(f"the user seed is not usable: {exc}") from None
        claims = decode_claims(self.jwt)
        if claims.get("sub") != self.key.public_key:
            raise CredsError("the JWT's subject is not the seed's public key: the file mixes two users")
        self.name = str(claims.get("name", ""))

    def callbacks(self) -> tuple[Callable[[], bytes], Callable[[str], bytes]]:
        """nats-py's `user_jwt_cb` and `signature_cb` (sign the connect nonce; no file read on the loop)."""

        def user_jwt() -> bytes:
            return self.jwt.encode()

        def signature(nonce: str) -> bytes:
            return base64.b64encode(self.key.sign(nonce.encode()))

        return user_jwt, signature
