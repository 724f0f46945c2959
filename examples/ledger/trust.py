"""What the ledger believes of an event: who it speaks for comes from its subject, when from the server.

The driver's NATS users are scoped by subject: a node's preparer may publish only
`dra.v1.claim.<namespace>.<its node>.<event>`. The body is whatever that preparer wrote. So:

- identity: each subject token named in the contract's `binds` (index.json) must name what the
  body field names (`claim_namespace`, `node`, `event`), and an `event_id` that carries a node
  (`<node>/<claim uid>/<preparation>/<event>`) must carry the subject's; otherwise the event is
  not accounted (`identity_mismatches`);
- de-duplication: by the event id alone, scoped by the subject's node, so no node's id can
  collide with another's (the `Nats-Msg-Id` header is not trusted: any publisher sets it);
- time: the body's `observed_at` is bounded by the JetStream server's timestamp of the message
  (`[server - MAX_LAG_S, server]`), so a forged time bills at most MAX_LAG_S too much.
"""

from __future__ import annotations

import datetime
from typing import Any

MAX_LAG_S = 3600.0
"""How much earlier than the server stored it an event may say it happened: the preparer queues
events while NATS is away, and its clock may be a little behind. An older or later body time is
replaced by the nearest bound (counted in `clamped_times`)."""


def token(value: str) -> str:
    """A value as the driver writes it into one subject token (outside [A-Za-z0-9_-] becomes `_`)."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "_" for c in value) or "_"


def subject_tokens(pattern: str, subject: str) -> dict[str, str] | None:
    """`{"namespace": "team-a", ...}` for `dra.v1.claim.team-a...` against `dra.v1.claim.{namespace}...`."""
    want, got = pattern.split("."), subject.split(".")
    if len(want) != len(got):
        return None
    out: dict[str, str] = {}
    for w, g in zip(want, got, strict=True):
        if w.startswith("{") and w.endswith("}"):
            out[w[1:-1]] = g
        elif w != g:
            return None
    return out


def id_node(event_id: str) -> str | None:
    """The node an event id carries; "" for none (empty, or the older `<uid>/<event>/<generation>`);
    None for an id of neither shape."""
    parts = event_id.split("/")
    if event_id == "" or len(parts) == 3:
        return ""
    if len(parts) == 4 and all(parts):
        return parts[0]
    return None


def mismatch(pattern: str, binds: dict[str, str], subject: str, event: dict[str, Any]) -> str:
    """Why the event may not speak for what its subject names; "" when it may."""
    tokens = subject_tokens(pattern, subject)
    if tokens is None:
        return f"subject {subject} is not of the form {pattern}"
    for name, field in binds.items():
        if name in tokens and token(str(event.get(field, ""))) != tokens[name]:
            return f"body {field}={event.get(field)!r} but the subject names {tokens[name]!r}"
    node = id_node(str(event.get("event_id", "")))
    if node is None or (node and "node" in tokens and node != tokens["node"]):
        return f"event_id {event.get('event_id')!r} does not belong to node {tokens.get('node')!r}"
    return ""


def event_key(event: dict[str, Any], subject_node: str, stream_seq: int) -> str:
    """The de-duplication key: the event id under the subject's node (else the stream sequence)."""
    event_id = str(event.get("event_id", ""))
    if not event_id:
        return f"seq:{stream_seq}"
    return f"id:{event_id}" if id_node(event_id) else f"id:{subject_node}/{event_id}"


def server_time(metadata: Any) -> float | None:
    """The JetStream server's timestamp of a message (seconds), when the metadata has one."""
    stamp = getattr(metadata, "timestamp", None)
    if isinstance(stamp, datetime.datetime):
        return stamp.timestamp()
    if isinstance(stamp, (int, float)):
        return float(stamp)
    return None


def bounded_time(body_at: float, server_at: float | None, max_lag_s: float = MAX_LAG_S) -> tuple[float, bool]:
    """(the time to account, whether the body's time was out of bounds and replaced)."""
    if server_at is None:
        return body_at, False
    bounded = min(max(body_at, server_at - max_lag_s), server_at)
    return bounded, bounded != body_at
