"""The event catalog: every message type bound to its subject pattern, in one place.

Subjects are versioned and hierarchical so that NATS permissions and subscriptions can be
scoped by node, device, namespace or domain. `{token}` marks one subject token.
Third parties read the JSON Schemas that `gpu-dra events schema` derives from this table.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Literal

from shared.events.base import Message
from shared.events.claims import ClaimLifecycle
from shared.events.computedomain import (
    DomainDeleted,
    DomainMember,
    DomainStatusChanged,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    MemberLeft,
)
from shared.events.deadletter import DeadLetter
from shared.events.devices import (
    InjectXidReply,
    InjectXidRequest,
    MigCreateReply,
    MigCreateRequest,
    MigDestroyReply,
    MigDestroyRequest,
    MpsStartReply,
    MpsStartRequest,
    MpsStopReply,
    MpsStopRequest,
    PartitionActivateReply,
    PartitionActivateRequest,
    PartitionDeactivateReply,
    PartitionDeactivateRequest,
    SetSharingReply,
    SetSharingRequest,
)
from shared.events.health import DeviceHealth
from shared.events.inventory import InventoryWithdrawn, NodeInventory
from shared.events.telemetry import NodeTelemetry

Pattern = Literal["event", "request", "kv"]
NODE_ROLES = ("discovery", "preparer", "cd-agent")  # the services on every node, each a NATS user `<role>.<node>`
GATE_SUBJECT = "dra.v1.gate"
"""The state gate's requests (services/stategate): `dra.v1.gate.<node>.<role>.<JetStream API call>` asks it to
make that `$JS.API.` call, `dra.v1.gate.<node>.<role>.PUB.<subject>` to store a message on `<subject>`;
the answer is the server's, sent to the asker's inbox only. Outside every stream's subjects."""
PUBLISHER_PRESENCE_SUBJECT = "dra.v1.presence.publisher"
"""Each publisher replica answers empty requests on `dra.v1.presence.publisher.<replica>` while its NATS
connection lasts; its peers probe there (shared.presence) to see a killed replica gone before its lease runs
out. Core NATS, empty bodies, outside every stream's subjects; only the publisher's identity may use it."""


def gate_prefix(node: str, role: str) -> str:
    """The JetStream API prefix of `<role>.<node>`: its calls go to the state gate, never to `$JS.API`."""
    return f"{GATE_SUBJECT}.{node}.{role}"


_TOKEN = re.compile(r"\{(\w+)\}", re.ASCII)
_SAFE_TOKEN = re.compile(r"[A-Za-z0-9_\-]+")  # fullmatch only: `$` would let a trailing newline through


class SubjectError(ValueError):
    """A subject token was missing or not a single safe NATS token."""


def as_token(value: str) -> str:
    """`value` as one subject token or KV-key token: every character outside [A-Za-z0-9_-] becomes `_`.

    Producers name subjects with it; consumers compare a body's field with the subject through it."""
    if _SAFE_TOKEN.fullmatch(value):  # the usual case (a Kubernetes name): a fifth of the cost of the walk
        return value
    return "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "_" for c in value) or "_"


Binds = tuple[tuple[str, str], ...]
"""(subject or key token, body field): the body field must name what the token names."""


def bound_fields(message: Message, tokens: dict[str, str], binds: Binds) -> list[tuple[str, str, str]]:
    """(field, token value, body value) for each bound field whose body value disagrees with its token."""
    wrong = []
    for token, field_name in binds:
        if token not in tokens:
            continue
        body = str(getattr(message, field_name, ""))
        if as_token(body) != as_token(tokens[token]):
            wrong.append((field_name, tokens[token], body))
    return wrong


def _match_tokens(pattern: list[str], parts: list[str]) -> dict[str, str] | None:
    """The `{token}` values of `parts` against a same-length `pattern`; None where a literal differs."""
    values: dict[str, str] = {}
    for want, got in zip(pattern, parts, strict=True):
        name = _TOKEN.fullmatch(want)
        if name:
            values[name.group(1)] = got
        elif want != got:
            return None
    return values


@dataclass(frozen=True)
class Entry:
    """One catalog entry: a message type on a subject pattern."""

    name: str
    subject: str  # e.g. "dra.v1.inventory.{node}"
    message: type[Message]
    pattern: Pattern
    summary: str
    reply: type[Message] | None = None
    binds: Binds = ()  # identity: NATS permissions authenticate the subject, so its tokens bind the body
    # a request's askers: the roles whose inbox on the subject's node a reply may go to (`<role>.<node>`;
    # the admin too). The responder answers nothing else: a request relayed or redirected is refused.
    requesters: tuple[str, ...] = ()
    # an event kept in a stream (JetStream publish, replayable); False: core NATS only, live or lost (telemetry)
    durable: bool = True

    @functools.cached_property
    def tokens(self) -> tuple[str, ...]:
        """The subject's `{token}` names, in order."""
        return tuple(_TOKEN.findall(self.subject))

    def parse(self, subject: str) -> dict[str, str] | None:
        """The token values of a concrete subject of this entry; None when it is not one."""
        pattern = self.subject.split(".")
        parts = subject.split(".")
        if len(parts) != len(pattern):
            return None
        return _match_tokens(pattern, parts)

    def format(self, **tokens: str) -> str:
        """The concrete subject; each token must be one NATS token (no dots, spaces or wildcards)."""
        missing = [t for t in self.tokens if t not in tokens]
        if missing:
            raise SubjectError(f"subject {self.subject!r} needs tokens {missing}")
        for key, value in tokens.items():
            if not _SAFE_TOKEN.fullmatch(value):
                raise SubjectError(f"subject token {key}={value!r} must match [A-Za-z0-9_-]+ (no dots or wildcards)")
        return self.subject.format_map(tokens)  # `{name}` is str.format's own syntax; no other braces in a subject

    def wildcard(self, **tokens: str) -> str:
        """A subscription subject: given tokens filled in, the rest as `*`."""
        return _TOKEN.sub(lambda m: tokens.get(m.group(1), "*"), self.subject)


INVENTORY = Entry(
    "inventory",
    "dra.v1.inventory.{node}",
    NodeInventory,
    "event",
    "A node's GPU inventory changed (also the last value in KV bucket dra-inventory, key <node>).",
    binds=(("node", "node"),),
)
INVENTORY_WITHDRAWN = Entry(
    "inventory-withdrawn",
    "dra.v1.inventory-withdrawn.{node}",
    InventoryWithdrawn,
    "event",
    "A node's discovery withdrew its inventory for good; its ResourceSlices are deleted.",
    binds=(("node", "node"),),
)
HEALTH = Entry(
    "device-health",
    "dra.v1.health.{node}.{device}",
    DeviceHealth,
    "event",
    "A device's health changed (XID, GPU lost, recovered); last value in KV dra-health.",
    binds=(("node", "node"), ("device", "device")),
)
TELEMETRY = Entry(
    "telemetry",
    "dra.v1.telemetry.{node}",
    NodeTelemetry,
    "event",
    "A node's device utilisation (SM %, memory, power, temperature), every interval; core NATS, not stored.",
    binds=(("node", "node"),),
    durable=False,
)
CLAIM = Entry(
    "claim-lifecycle",
    "dra.v1.claim.{namespace}.{node}.{event}",
    ClaimLifecycle,
    "event",
    "A claim was prepared, failed, unprepared or rolled back on a node.",
    binds=(("namespace", "claim_namespace"), ("node", "node"), ("event", "event")),
)
DEVICE_SET_SHARING = Entry(
    "device-set-sharing",
    "dra.v1.device.{node}.set-sharing",
    SetSharingRequest,
    "request",
    "Set compute mode and time-slice interval on GPUs.",
    SetSharingReply,
    requesters=("preparer",),
)
DEVICE_MIG_CREATE = Entry(
    "device-mig-create",
    "dra.v1.device.{node}.mig-create",
    MigCreateRequest,
    "request",
    "Create a MIG device at a placement (idempotent).",
    MigCreateReply,
    requesters=("preparer",),
)
DEVICE_MIG_DESTROY = Entry(
    "device-mig-destroy",
    "dra.v1.device.{node}.mig-destroy",
    MigDestroyRequest,
    "request",
    "Destroy a MIG device (idempotent).",
    MigDestroyReply,
    requesters=("preparer",),
)
DEVICE_MPS_START = Entry(
    "device-mps-start",
    "dra.v1.device.{node}.mps-start",
    MpsStartRequest,
    "request",
    "Start an MPS control daemon for GPUs with limits (idempotent).",
    MpsStartReply,
    requesters=("preparer",),
)
DEVICE_MPS_STOP = Entry(
    "device-mps-stop",
    "dra.v1.device.{node}.mps-stop",
    MpsStopRequest,
    "request",
    "Stop an MPS control daemon (idempotent).",
    MpsStopReply,
    requesters=("preparer",),
)
DEVICE_PARTITION_ACTIVATE = Entry(
    "device-partition-activate",
    "dra.v1.device.{node}.partition-activate",
    PartitionActivateRequest,
    "request",
    "Activate a Fabric Manager NVLink partition for a claim's GPUs (idempotent).",
    PartitionActivateReply,
    requesters=("preparer",),
)
DEVICE_PARTITION_DEACTIVATE = Entry(
    "device-partition-deactivate",
    "dra.v1.device.{node}.partition-deactivate",
    PartitionDeactivateRequest,
    "request",
    "Deactivate a Fabric Manager NVLink partition (idempotent).",
    PartitionDeactivateReply,
    requesters=("preparer",),
)
DEVICE_INJECT_XID = Entry(
    "device-inject-xid",
    "dra.v1.device.{node}.inject-xid",
    InjectXidRequest,
    "request",
    "Simulation: raise an XID or GPU-lost on a device, or recover it.",
    InjectXidReply,
    requesters=("preparer",),
)
CD_MEMBER = Entry(
    "cd-member",
    "dra.v1.cd.{domain_uid}.member.{node}",
    DomainMember,
    "event",
    "A node joined, changed or left a ComputeDomain (last value in KV dra-cd-members).",
    binds=(("domain_uid", "domain_uid"), ("node", "node")),
)
CD_STATUS = Entry(
    "cd-status",
    "dra.v1.cd.{domain_uid}.status",
    DomainStatusChanged,
    "event",
    "A ComputeDomain's readiness changed.",
    binds=(("domain_uid", "domain_uid"),),
)
CD_MEMBER_LEFT = Entry(
    "cd-member-left",
    "dra.v1.cd.{domain_uid}.left.{node}",
    MemberLeft,
    "event",
    "A node left a ComputeDomain (its KV entry under <domain-uid>.<node> was deleted).",
    binds=(("domain_uid", "domain_uid"), ("node", "node")),
)
CD_DELETED = Entry(
    "cd-deleted",
    "dra.v1.cd.{domain_uid}.deleted",
    DomainDeleted,
    "event",
    "A ComputeDomain is being deleted; its daemons stop and its members leave.",
    binds=(("domain_uid", "domain_uid"),),
)
# The agent's requests are node-scoped like the device operations, and deliberately outside
# `dra.v1.cd.>`: that prefix is captured by the DRA_EVENTS stream, which would answer a request
# with a JetStream ack, and its second token is a domain UID.
CD_AGENT_JOIN = Entry(
    "cd-agent-join",
    "dra.v1.cd-agent.{node}.join",
    JoinRequest,
    "request",
    "A channel claim for a ComputeDomain is prepared on a node: run its IMEX daemon, join.",
    JoinReply,
    requesters=("preparer",),
)
CD_AGENT_LEAVE = Entry(
    "cd-agent-leave",
    "dra.v1.cd-agent.{node}.leave",
    LeaveRequest,
    "request",
    "A channel claim was unprepared on a node; the last one leaves the domain.",
    LeaveReply,
    requesters=("preparer",),
)
DEAD_LETTER = Entry(
    "dead-letter",
    "dra.v1.deadletter.{identity}.{consumer}",
    DeadLetter,
    "event",
    "A message a consumer could not decode, with the reason; filed under the NATS identity of the "
    "consumer that saw it, the only dead-letter subjects that identity may publish.",
)

CATALOG: tuple[Entry, ...] = (
    INVENTORY,
    INVENTORY_WITHDRAWN,
    HEALTH,
    TELEMETRY,
    CLAIM,
    DEVICE_SET_SHARING,
    DEVICE_MIG_CREATE,
    DEVICE_MIG_DESTROY,
    DEVICE_MPS_START,
    DEVICE_MPS_STOP,
    DEVICE_PARTITION_ACTIVATE,
    DEVICE_PARTITION_DEACTIVATE,
    DEVICE_INJECT_XID,
    CD_MEMBER,
    CD_STATUS,
    CD_MEMBER_LEFT,
    CD_DELETED,
    CD_AGENT_JOIN,
    CD_AGENT_LEAVE,
    DEAD_LETTER,
)


FLEET_NODES = 65_000
"""The largest fleet the streams and buckets are sized for (the inventory bucket's bytes, the consumer limits)."""
CONSUMERS_PER_NODE = 4
"""Consumers a node may hold on one stream or bucket at a time: each of its services (NODE_ROLES) at most one
watch there, and one more ended but not yet removed (shared.jetstream.WATCH_INACTIVE_S)."""
CLUSTER_CONSUMERS = 4096
"""Beside the nodes': the cluster services' watches and durable consumers, and third-party readers'."""
FLEET_CONSUMERS = FLEET_NODES * CONSUMERS_PER_NODE + CLUSTER_CONSUMERS
"""Each stream's and bucket's consumer limit (`max_consumers`). nats-server 2.15 refuses a stream's 1,001st
consumer when neither the stream nor the account sets a limit (err 10026), -1 included: one watch per node on
a bucket stops a fleet at 1,000 nodes. An account limit below it is kept (Bus.provision)."""


@dataclass(frozen=True)
class Stream:
    """A JetStream stream: retained events third parties can replay."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    max_bytes: int = 256 * 1024 * 1024
    max_msg_size: int = 64 * 1024  # the server refuses a larger message: no publisher fills the stream in a few
    # per subject, the oldest kept and a newer one refused once a subject holds this many (-1: no limit)
    max_msgs_per_subject: int = -1
    discard_new: bool = False  # when full, refuse what comes (True) or drop the oldest (False)
    max_consumers: int = FLEET_CONSUMERS


@dataclass(frozen=True)
class Bucket:
    """A JetStream KV bucket holding last values."""

    name: str
    message: type[Message]
    history: int = 1
    ttl_s: float = 0.0  # 0: no expiry
    key: str = ""  # key pattern, e.g. "{node}"
    key_rest: bool = False  # the pattern's last token takes the rest of a longer key (dotted device names)
    binds: Binds = ()  # identity: NATS permissions scope writes by key, so the key binds the value
    max_value_size: int = 16 * 1024  # the server refuses a larger value
    max_bytes: int = 256 * 1024 * 1024  # the bucket refuses writes past it (KV discards new)
    max_consumers: int = FLEET_CONSUMERS  # its watches: one or two per node (shared.events.catalog.FLEET_CONSUMERS)

    def parse_key(self, key: str) -> dict[str, str] | None:
        """The token values of a key of this bucket's pattern; None for a key of another shape
        (e.g. the index bids `<uid>.idx.<clique>.<n>.<node>` in dra-cd-members: not bound here,
        NATS permissions decide who writes them)."""
        pattern = self.key.split(".") if self.key else []
        parts = key.split(".")
        if not pattern or len(parts) < len(pattern):
            return None
        if len(parts) > len(pattern):
            if not self.key_rest:
                return None
            parts = [*parts[: len(pattern) - 1], ".".join(parts[len(pattern) - 1 :])]
        return _match_tokens(pattern, parts)


EVENTS_STREAM = Stream(
    "DRA_EVENTS",
    ("dra.v1.inventory.>", "dra.v1.inventory-withdrawn.>", "dra.v1.health.>", "dra.v1.claim.>", "dra.v1.cd.>"),
    max_age_s=7 * 24 * 3600,
    max_msg_size=1024 * 1024,  # an inventory event carries a whole node's GPUs (the server's max payload)
    # How far the slowest durable consumer may fall behind before the oldest events it has not read are
    # evicted (limits retention: no consumer holds events for another). A claim event is 1,123 bytes stored
    # (bench/events_bench.py), so 2 GiB keeps ~1.9 million: a minute at 10,000/s is 600,000 (~670 MB; the
    # former 256 MiB evicted a reader at 1,000/s after ~25 s of it). Within the shipped server's 8 GB file
    # store (deploy/nats/nats.conf) beside the buckets' limits (~2.6 GiB).
    max_bytes=2 * 1024 * 1024 * 1024,
)
# A letter keeps up to 64 KiB of the refused payload. Per identity and consumer, the first letters are kept
# (the forensic record of an attack) and a flood of later ones is refused, never the other way round.
DEAD_LETTER_STREAM = Stream(
    "DRA_DEADLETTER",
    ("dra.v1.deadletter.>",),
    max_age_s=3 * 24 * 3600,
    max_bytes=64 << 20,
    max_msg_size=80 * 1024,
    max_msgs_per_subject=256,
    discard_new=True,
)
STREAMS: tuple[Stream, ...] = (EVENTS_STREAM, DEAD_LETTER_STREAM)


def stream_of(subject: str) -> Stream | None:
    """The stream that stores `subject` (an entry's pattern or a concrete subject); None: core NATS only."""
    prefix = subject.split("{", 1)[0]
    for stream in STREAMS:
        if any(prefix.startswith(s.rstrip(">")) for s in stream.subjects):
            return stream
    return None


# 2 GiB: one value per node (history 1, each node writes only its own key); 65,000 nodes x 8 H100s is ~1.3 GB
# (bench/fleet_bench.py), past the 256 MiB default at ~13,000 nodes
INVENTORY_BUCKET = Bucket(
    "dra-inventory",
    NodeInventory,
    key="{node}",
    binds=(("node", "node"),),
    max_value_size=1024 * 1024,
    max_bytes=2 * 1024 * 1024 * 1024,
)
HEALTH_BUCKET = Bucket(
    "dra-health", DeviceHealth, key="{node}.{device}", key_rest=True, binds=(("node", "node"), ("device", "device"))
)
CD_MEMBERS_BUCKET = Bucket(
    "dra-cd-members", DomainMember, key="{domain_uid}.{node}", binds=(("domain_uid", "domain_uid"), ("node", "node"))
)
BUCKETS: tuple[Bucket, ...] = (INVENTORY_BUCKET, HEALTH_BUCKET, CD_MEMBERS_BUCKET)


def entry(name: str) -> Entry:
    """The catalog entry called `name`."""
    for item in CATALOG:
        if item.name == name:
            return item
    raise KeyError(f"no catalog entry {name!r}; known: {', '.join(e.name for e in CATALOG)}")
