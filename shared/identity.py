"""Identity on the bus: a message speaks for what its subject (or KV key) names, and nothing else.

NATS permissions authenticate subjects, not bodies: `discovery.<node>` may publish only
`dra.v1.inventory.<node>` and write only its own KV keys. So the node (and, for claim events, the
namespace) a consumer acts on is the one its subject names; a body naming another is refused
here, for every consumer, from the catalog's `binds` (shared/bus.py calls these checks on every
subscription and every TypedKV read or watch). A refusal is counted
(`gpu_dra_identity_mismatch_total{consumer,subject_kind}`), logged as a warning naming both
identities, and dead-lettered by the bus with reason `identity-mismatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter

from shared.events.base import Message
from shared.events.catalog import Bucket, Entry, bound_fields
from shared.events.claims import ClaimLifecycle, event_id_node
from shared.logs import get_logger

log = get_logger(__name__)

REASON = "identity-mismatch"

MISMATCHES = Counter(
    "gpu_dra_identity_mismatch_total",
    "Messages and KV values refused because their body names another identity than their subject or key",
    ["consumer", "subject_kind"],
)


@dataclass(frozen=True)
class Mismatch:
    """What a body claimed against what its subject or key authenticates."""

    kind: str  # catalog entry or bucket name
    where: str  # the subject, or `$KV.<bucket>.<key>`
    fields: tuple[tuple[str, str, str], ...]  # (body field, subject's value, body's value)

    @property
    def error(self) -> str:
        said = ", ".join(f"{name}={body!r} (subject says {subject!r})" for name, subject, body in self.fields)
        return (
            f"{REASON}: the body of a {self.kind} message on {self.where} names {said}; a message may "
            "only speak for what its subject names (the publisher's NATS user is scoped to that subject)"
        )


def check_event(entry: Entry, subject: str, message: Message) -> Mismatch | None:
    """The mismatch between `message` and the `entry` subject it arrived on, or None when they agree."""
    if not entry.binds:
        return None
    tokens = entry.parse(subject)
    if tokens is None:
        return Mismatch(entry.name, subject, (("subject", entry.subject, subject),))
    wrong = bound_fields(message, tokens, entry.binds)
    if isinstance(message, ClaimLifecycle) and "node" in tokens:
        id_node = event_id_node(message.event_id)
        if id_node is None or (id_node and id_node != tokens["node"]):
            wrong.append(("event_id", f"{tokens['node']}/...", message.event_id))
    return Mismatch(entry.name, subject, tuple(wrong)) if wrong else None


def check_kv(bucket: Bucket, key: str, value: Message) -> Mismatch | None:
    """The mismatch between a KV value and the key it is stored under, or None when they agree."""
    if not bucket.binds:
        return None
    tokens = bucket.parse_key(key)
    if tokens is None:
        return None  # a key of another shape: only cluster services may write those
    wrong = bound_fields(value, tokens, bucket.binds)
    return Mismatch(bucket.name, f"$KV.{bucket.name}.{key}", tuple(wrong)) if wrong else None


def refused(consumer: str, mismatch: Mismatch) -> None:
    """Count and log a refusal (the caller dead-letters it and does not act on the message)."""
    MISMATCHES.labels(consumer=consumer, subject_kind=mismatch.kind).inc()
    for name, subject_value, body_value in mismatch.fields:
        log.warning(
            "message refused: its body names another identity than its subject",
            consumer=consumer,
            subject=mismatch.where,
            kind=mismatch.kind,
            field=name,
            subject_names=subject_value,
            body_names=body_value,
        )
