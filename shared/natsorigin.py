"""Where a message on a core subscription came from, as far as its receiver can tell.

NATS checks who may publish on a subject, but the server itself publishes too, on any subject a client
names: a JetStream consumer delivers to the `deliver_subject` in its create request's body, and every
JetStream API answer (a direct get's stored message, a publish ack) goes to the reply subject the
asker chose. Neither is checked against the asker's permissions, so a node could have the server
deliver its own stored bytes on another node's device-request or health subject. What the server
relays carries its marks: a consumer delivery's reply is `$JS.ACK.<stream>...`, and a direct get's
answer has `Nats-Stream` / `Nats-Subject` headers. A publisher's own message has neither.

`relayed()` names the mark; `foreign_requester()` says whether a request's reply subject is the inbox
of one of the identities the catalog lets ask (shared.events.catalog.Entry.requesters): a request the
server relayed has no such reply, and no one else may publish on the request subject.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from shared.events.catalog import Entry

RELAYED = "relayed"  # the dead-letter reason and metric label
NOT_REQUESTER = "not-requester"
_RELAY_HEADERS = ("Nats-Stream", "Nats-Subject", "Nats-Sequence")


def relayed(reply: str | None, headers: Mapping[str, str] | None) -> str:
    """Why a message on a core subscription was sent by the server rather than a publisher ('' if it was not)."""
    if reply and reply.startswith("$JS.ACK."):
        return f"a JetStream consumer's delivery (reply {reply.split('.', 3)[2]}...), not a publish"
    for name in _RELAY_HEADERS:
        if headers and name in headers:
            return f"a JetStream answer carrying {name}: {headers[name]}, not a publish"
    return ""


def foreign_requester(
    entry: Entry, tokens: Mapping[str, str], reply: str | None, inbox_prefix: Callable[[str], str]
) -> str:
    """Why a request on `entry` must not be answered ('' when its reply is an allowed asker's inbox).

    The askers are `<role>.<node>` for each of the entry's requesters, on the node its subject names,
    and the admin (`inbox_prefix(user)`: shared.bus's naming). An entry without requesters, or a subject
    without a node, accepts any asker."""
    node = tokens.get("node")
    if not entry.requesters or not node:
        return ""
    askers = [f"{role}.{node}" for role in entry.requesters] + ["admin"]
    if reply and any(reply.startswith(inbox_prefix(user) + ".") for user in askers):
        return ""
    shown = reply or "none"
    return (
        f"the reply subject {shown[:80]!r} is not the inbox of {' or '.join(askers)}: only they may ask "
        f"{entry.name} on node {node}"
    )
