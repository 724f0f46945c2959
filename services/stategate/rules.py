"""Whether a node service's call on the shared state is one it may make: NATS subject-pattern matching
against shared.natsusers.node_state_rights, and the checks of a call's body that the server does not make."""

from __future__ import annotations

import functools
import json

from shared.bus import inbox_prefix
from shared.natsusers import UsersError, node_state_rights, node_user


class Refused(Exception):
    """A call the asker may not make; the message says why (sent back as the JetStream error)."""


def matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` one token, `>` one or more trailing tokens."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


@functools.lru_cache(maxsize=4096)
def _rights(role: str, node: str) -> tuple[str, ...]:
    return tuple(node_state_rights(role, node))


def check_subject(role: str, node: str, subject: str) -> None:
    """Refused unless `<role>.<node>` may make the call or store on `subject`."""
    try:
        rights = _rights(role, node)
    except UsersError as exc:
        raise Refused(str(exc)) from None
    if not any(matches(pattern, subject) for pattern in rights):
        raise Refused(f"{node_user(role, node)} may not {subject!r}")


def check_consumer(role: str, node: str, body: bytes) -> None:
    """A consumer create may deliver only to the asker's own inbox (push; no pull consumers, whose fetch
    requests would name a reply subject of the asker's choice), with no description of another stream."""
    try:
        config = json.loads(body or b"{}").get("config") or {}
    except (ValueError, AttributeError):
        raise Refused("the consumer create body is not a JSON object") from None
    deliver = str(config.get("deliver_subject") or "")
    own = inbox_prefix(node_user(role, node)) + "."
    if not deliver.startswith(own):
        raise Refused(
            f"a consumer of {node_user(role, node)} must deliver to its own inbox {own}>, "
            f"not {deliver or 'nowhere (a pull consumer)'!r}"
        )


def check_store_headers(headers: dict[str, str] | None) -> None:
    """A store may not roll up (purge) anything: the buckets refuse it too, this says so first."""
    for name in headers or {}:
        if name.lower() == "nats-rollup":
            raise Refused("a Nats-Rollup header purges other keys: not allowed through the gate")
