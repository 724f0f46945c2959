"""NATS users and subject permissions for a deployment, derived from the event catalog.

Owns who may publish and subscribe to what: one user per cluster service (publisher, controller,
admin, and the state gate); because nats-server config-file users have no permission templates, one user
per node *and* node service (`discovery.<node>`, `preparer.<node>`, `cd-agent.<node>`), whose server rights
are only to ask the state gate (services/stategate) for JetStream calls, to send its node's requests and
to answer its node's preparer: what the gate then allows it (`node_state_rights`) names only that node's
subjects and KV keys. Read-only `reader.<name>` users see the claim events of the namespaces they are
granted, and the dashboard's `reader.dashboard` sees every claim and health event (replaying the claim events
of the last day through an ordered consumer) and publishes no event.
Every user takes replies on its own `_INBOX_<identity>.>` and files dead letters under
`dra.v1.deadletter.<identity>.>` only (shared.bus). Renders the same permissions either into user JWTs
(shared.natscreds, `gpu-dra nats credentials`, what deployments use) or into a password
`authorization {}` block (render_authorization: tests and local servers).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shared.bus import identity_token, inbox_prefix
from shared.events.catalog import (
    BUCKETS,
    CATALOG,
    CD_AGENT_JOIN,
    CD_AGENT_LEAVE,
    CD_DELETED,
    CD_MEMBER,
    CD_MEMBER_LEFT,
    CD_MEMBERS_BUCKET,
    CD_STATUS,
    CLAIM,
    DEAD_LETTER,
    EVENTS_STREAM,
    GATE_SUBJECT,
    HEALTH,
    HEALTH_BUCKET,
    INVENTORY,
    INVENTORY_BUCKET,
    INVENTORY_WITHDRAWN,
    NODE_ROLES,
    PUBLISHER_PRESENCE_SUBJECT,
    STREAMS,
    TELEMETRY,
    Entry,
    gate_prefix,
)

NAMESPACE = "gpu-dra"
GATE_ROLE = "gate"  # services/stategate: every node's calls on the shared state go through it
CLUSTER_ROLES = ("publisher", "controller", "admin", GATE_ROLE)
READER_ROLE = "reader"
# Node names become one subject token; the catalog accepts exactly this alphabet.
_NODE_TOKEN = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")
JS = "$JS.API"
# The publisher's own membership bucket (services/publisher/ownership.py), not in the catalog.
PUBLISHER_REPLICAS_BUCKET = "dra-publisher-replicas"
ROUTE_USER = "route"  # the cluster-route credential (nats-cluster.conf); not a client user


class UsersError(ValueError):
    """Bad input for the generator; the message says what and how to fix it."""


@dataclass
class Permissions:
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)
    allow_responses: bool = False
    deny_publish: list[str] = field(default_factory=list)  # carved out of `publish` (a deny wins)

    def as_config(self) -> dict[str, object]:
        publish: dict[str, list[str]] = {"allow": sorted(set(self.publish))}
        if self.deny_publish:
            publish["deny"] = sorted(set(self.deny_publish))
        out: dict[str, object] = {"publish": publish, "subscribe": {"allow": sorted(set(self.subscribe))}}
        if self.allow_responses:
            out["allow_responses"] = {"max": 1, "expires": "1m"}
        return out


def check_node(node: str) -> str:
    """A node name usable as one NATS subject token, or UsersError saying why not."""
    if "." in node:
        raise UsersError(
            f"node name {node!r} contains '.', which splits a NATS subject token; the event catalog "
            "(shared/events/catalog.py) needs node names of [a-z0-9-] only: use short node names "
            "(kubelet --hostname-override) or wait for the catalog to encode dotted names"
        )
    if not _NODE_TOKEN.match(node):
        raise UsersError(f"node name {node!r} is not a Kubernetes node name of [a-z0-9-], 1-63 characters")
    return node


def _stream_names() -> list[str]:
    return [s.name for s in STREAMS] + [f"KV_{b.name}" for b in BUCKETS]


def _jetstream_base() -> list[str]:
    """What every service may ask of the JetStream API: account info, stream names and stream info
    (which also lists a KV bucket's keys). Creating or changing a stream is the provisioner's (admin,
    and the cluster services that own a bucket), never a node's."""
    subjects = [f"{JS}.INFO", f"{JS}.STREAM.NAMES"]  # NAMES: find the stream of a subject
    subjects += [f"{JS}.STREAM.INFO.{name}" for name in _stream_names()]
    return subjects


def _provision() -> list[str]:
    """The idempotent create / drift update that `Bus.provision()` sends (cluster services only)."""
    return [f"{JS}.STREAM.{verb}.{name}" for name in _stream_names() for verb in ("CREATE", "UPDATE")]


def _kv_read(bucket: str, keys: str = ">") -> list[str]:
    """Get and watch the keys `keys` of a KV bucket, by no other API.

    A get is a direct get whose subject names the key (the batch form `DIRECT.GET.<stream>` with a
    body, and STREAM.MSG.GET, which can read any sequence, are not allowed). A watch or key listing
    is a consumer created through `CONSUMER.CREATE.<stream>.<name>.<filter>`: the server refuses a
    create whose filter differs from the subject's, so the allowed filters are exactly `keys`
    (shared.bus names every KV consumer so that nats-py puts the filter there). The server does not
    check a consumer's delivery subject; every receiver refuses a delivery it did not ask for
    (shared.relayed)."""
    stream = f"KV_{bucket}"
    key_subject = f"$KV.{bucket}.{keys}"
    return [
        f"{JS}.DIRECT.GET.{stream}.{key_subject}",
        f"{JS}.CONSUMER.CREATE.{stream}.*.{key_subject}",
        f"{JS}.CONSUMER.INFO.{stream}.*",  # nats-py's KV watch reads its consumer's info (config, counts)
        f"$JS.FC.{stream}.>",
    ]


def _reply_to(*requesters: str) -> list[str]:
    """A responder's publish rights: the inboxes of those who may ask it, nothing else. nats-server's
    `allow_responses` would let it answer any reply subject a requester names, i.e. publish anywhere."""
    return [_own_inbox(user) for user in requesters]


def _own_inbox(user: str) -> str:
    return f"{inbox_prefix(user)}.>"


def _own_dead_letters(user: str) -> str:
    return DEAD_LETTER.wildcard(identity=identity_token(user)).replace(".*", ".>")


def _durable_consumer(stream: str) -> list[str]:
    return [
        f"{JS}.CONSUMER.CREATE.{stream}",
        f"{JS}.CONSUMER.CREATE.{stream}.>",
        f"{JS}.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"{JS}.CONSUMER.INFO.{stream}.>",
        f"{JS}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _events(entries: Iterable[Entry], **tokens: str) -> list[str]:
    return [e.wildcard(**tokens) for e in entries]


def node_state_rights(role: str, node: str) -> list[str]:
    """What `role` on `node` may do to the shared state (streams, KV buckets, the JetStream API), as NATS
    subject patterns. A node user holds none of these rights on the server: it asks the state gate
    (services/stategate), which checks each call against this list, and the body of a consumer create
    against the asker's inbox, before it makes the call itself. So no node can have the server publish
    where it may not (a consumer's delivery subject, an answer to a reply subject it names), write past
    its share, or roll up a bucket."""
    check_node(node)
    user = node_user(role, node)
    common = [*_jetstream_base(), _own_dead_letters(user)]
    if role == "discovery":
        return (
            common
            + _events((INVENTORY, INVENTORY_WITHDRAWN, HEALTH), node=node)
            + [f"$KV.{INVENTORY_BUCKET.name}.{node}", f"$KV.{HEALTH_BUCKET.name}.{node}.>"]
            + _kv_read(INVENTORY_BUCKET.name, node)
            + _kv_read(HEALTH_BUCKET.name, f"{node}.>")
        )
    if role == "preparer":
        return (
            common
            + _events((CLAIM,), node=node)
            + _kv_read(INVENTORY_BUCKET.name, node)
            + _kv_read(HEALTH_BUCKET.name, f"{node}.>")
            + _kv_read(CD_MEMBERS_BUCKET.name)
        )
    if role == "cd-agent":
        return (
            common
            + _events((CD_MEMBER, CD_MEMBER_LEFT), node=node)
            # its membership `<domain>.<node>` and its index bids `<domain>.idx.<clique>.<NN>.<node>`
            # (services/computedomain/membership.py): every key it writes ends in its node
            + [f"$KV.{CD_MEMBERS_BUCKET.name}.*.{node}", f"$KV.{CD_MEMBERS_BUCKET.name}.*.idx.*.*.{node}"]
            + _kv_read(CD_MEMBERS_BUCKET.name)
            + _kv_read(INVENTORY_BUCKET.name, node)  # its node's clique
            # the last status / deletion of a domain it is asked to join (an ordered consumer per subject)
            + [
                f"{JS}.CONSUMER.CREATE.{EVENTS_STREAM.name}.*.{CD_STATUS.wildcard()}",
                f"{JS}.CONSUMER.CREATE.{EVENTS_STREAM.name}.*.{CD_DELETED.wildcard()}",
                f"{JS}.CONSUMER.INFO.{EVENTS_STREAM.name}.*",
            ]
        )
    raise UsersError(f"unknown node role {role!r}; known: {', '.join(NODE_ROLES)}")


def node_permissions(role: str, node: str) -> Permissions:
    """What `role` on `node` may do on the server: ask the state gate for everything that touches a stream
    or bucket (node_state_rights), send its node's requests, answer only its node's preparer (and the
    admin), acknowledge the flow control of the watches the gate created for it."""
    node_state_rights(role, node)  # checks the role and node
    user = node_user(role, node)
    inbox = _own_inbox(user)
    agent_ops = [CD_AGENT_JOIN, CD_AGENT_LEAVE]
    device_ops = [e for e in CATALOG if e.pattern == "request" and e not in agent_ops]
    base = [f"{gate_prefix(node, role)}.>", *(f"$JS.FC.{name}.>" for name in _stream_names())]
    answers = _reply_to(node_user("preparer", node), "admin")
    if role == "discovery":
        # telemetry is core NATS (no stream, so not through the gate): the server checks the node token itself.
        # Its node's claim events drive the simulated NVML's load (services/discovery/simload.py).
        return Permissions(
            publish=[*base, *answers, *_events((TELEMETRY,), node=node)],
            subscribe=[*_events(device_ops, node=node), *_events((CLAIM,), node=node), inbox],
        )
    if role == "preparer":
        return Permissions(
            publish=base + _events(device_ops, node=node) + _events(agent_ops, node=node),
            # the kubelet's device-health stream follows this node's health events; a channel claim's
            # prepare waits for this node's membership to turn Ready by its events (no consumer)
            subscribe=[*_events((HEALTH, CD_MEMBER), node=node), inbox],
        )
    return Permissions(
        publish=base + answers,
        subscribe=[
            CD_STATUS.wildcard(),
            CD_MEMBER.wildcard(),
            CD_DELETED.wildcard(),
            *_events(agent_ops, node=node),
            inbox,
        ],
    )


def cluster_permissions(role: str) -> Permissions:
    """What a cluster service may do; none of them may publish a node's events."""
    common = [*_jetstream_base(), _own_dead_letters(role)]
    inbox = _own_inbox(role)
    if role == "publisher":
        replicas = PUBLISHER_REPLICAS_BUCKET
        return Permissions(
            publish=[
                *common,
                *_provision(),
                f"{JS}.STREAM.INFO.KV_{replicas}",
                f"{JS}.STREAM.CREATE.KV_{replicas}",
                f"$KV.{replicas}.>",
                f"{JS}.CONSUMER.DELETE.KV_{replicas}.*",
                *_kv_read(replicas),
                *_kv_read(INVENTORY_BUCKET.name),
                *_kv_read(HEALTH_BUCKET.name),
                *_durable_consumer(EVENTS_STREAM.name),
                # a withdrawn node's last values are removed by the publisher
                f"$KV.{INVENTORY_BUCKET.name}.*",
                f"$KV.{HEALTH_BUCKET.name}.>",
                # replicas probe one another's presence and answer into one another's inbox (one identity)
                f"{PUBLISHER_PRESENCE_SUBJECT}.*",
                inbox,
            ],
            subscribe=[*_events((INVENTORY, INVENTORY_WITHDRAWN, HEALTH)), f"{PUBLISHER_PRESENCE_SUBJECT}.*", inbox],
        )
    if role == "controller":
        members = CD_MEMBERS_BUCKET.name
        return Permissions(
            publish=common
            + _provision()
            + _events((CD_STATUS, CD_DELETED))  # a domain's status, and its deletion (agents stop its daemon)
            + _kv_read(members)
            + _durable_consumer(EVENTS_STREAM.name)
            + [f"$KV.{members}.>"],  # the owner of domain membership: assignments, a deleted domain's keys
            subscribe=["dra.v1.cd.>", inbox],
        )
    if role == "admin":
        return Permissions(publish=[">"], subscribe=[">"], allow_responses=False)
    if role == GATE_ROLE:
        # it makes every node's JetStream calls and answers every node's inbox, after checking both
        return Permissions(publish=[">"], subscribe=[f"{GATE_SUBJECT}.>", inbox])
    raise UsersError(f"unknown cluster role {role!r}; known: {', '.join(CLUSTER_ROLES)}")


def check_namespace(namespace: str) -> str:
    """A Kubernetes namespace name (one subject token), or UsersError saying why not."""
    if not _NODE_TOKEN.match(namespace):
        raise UsersError(f"namespace {namespace!r} is not a Kubernetes namespace name of [a-z0-9-], 1-63 characters")
    return namespace


def reader_permissions(name: str, namespaces: Iterable[str], others: Iterable[str] = ()) -> Permissions:
    """A read-only third party (billing, audit): the claim events of `namespaces`, nothing else.

    It may subscribe to those claim subjects and create JetStream consumers whose filter (in the
    create subject) lies inside them; no KV, no requests, no publishes of events, no stream info. Its one
    durable consumer (`reader_durable(name)`: a pull consumer with explicit acks, docs/events.md) it may
    also read, fetch from, ack and delete; no other consumer. A create names the consumer and the server
    creates *or updates* it, so every other reader's durable (`others`: their names) is denied: no reader
    can point another's durable at its own namespaces, which would make that one skip its events."""
    grants = sorted({check_namespace(ns) for ns in namespaces})
    if not grants:
        raise UsersError(f"reader {name!r} is granted no namespace; name at least one")
    user = reader_user(name)
    claims = [CLAIM.wildcard(namespace=ns) for ns in grants]
    stream, durable = EVENTS_STREAM.name, reader_durable(name)
    return Permissions(
        publish=[
            f"{JS}.STREAM.NAMES",  # which stream holds a subject
            *(f"{JS}.CONSUMER.CREATE.{stream}.*.dra.v1.claim.{ns}.>" for ns in grants),
            f"$JS.FC.{stream}.>",  # flow-control replies of its push consumers
            *(f"{JS}.CONSUMER.{verb}.{stream}.{durable}" for verb in ("INFO", "MSG.NEXT", "DELETE")),
            f"$JS.ACK.{stream}.{durable}.>",
        ],
        subscribe=[*claims, _own_inbox(user)],
        deny_publish=_others_durables(name, others),
    )


def reader_durable(name: str) -> str:
    """The durable consumer on DRA_EVENTS that reader `name` owns: its identity token (`reader_billing`)."""
    return identity_token(reader_user(name))


DASHBOARD_READER = "dashboard"  # the reader `gpu-dra dashboard` connects as: reader.dashboard


def dashboard_permissions(others: Iterable[str] = ()) -> Permissions:
    """The fleet page (`gpu-dra dashboard`): read-only, like every reader, but of every namespace's claim
    events and every device's health and telemetry. Its GPU-hours replay the last day of claim events (one
    ordered consumer, services/dashboard/state.py): it may create consumers on DRA_EVENTS whose filter (in the
    create subject) lies inside `dra.v1.claim.>` and answer their flow control, nothing else of JetStream (no
    stream info, no KV, no other stream, no consumer's info, fetch or ack). As for a reader, a create of another
    reader's durable (`others`: the readers' names) is denied. It publishes only those and its own dead letters."""
    user = reader_user(DASHBOARD_READER)
    stream = EVENTS_STREAM.name
    return Permissions(
        publish=[
            f"{JS}.CONSUMER.CREATE.{stream}.*.dra.v1.claim.>",
            f"$JS.FC.{stream}.>",
            _own_dead_letters(user),
        ],
        subscribe=[CLAIM.wildcard(), HEALTH.wildcard(), TELEMETRY.wildcard(), _own_inbox(user)],
        deny_publish=_others_durables(DASHBOARD_READER, others),
    )


def _others_durables(name: str, others: Iterable[str]) -> list[str]:
    """The creates of every other reader's durable on DRA_EVENTS (a create of an existing name updates it)."""
    stream = EVENTS_STREAM.name
    return [
        f"{JS}.CONSUMER.CREATE.{stream}.{reader_durable(other)}.>" for other in sorted(set(others)) if other != name
    ]


def node_user(role: str, node: str) -> str:
    return f"{role}.{node}"


def reader_user(name: str) -> str:
    if not _NODE_TOKEN.match(name):
        raise UsersError(f"reader name {name!r} must be [a-z0-9-], 1-63 characters")
    return f"{READER_ROLE}.{name}"


def all_users(nodes: Iterable[str], readers: Mapping[str, Iterable[str]] | None = None) -> dict[str, Permissions]:
    """Every user: the cluster services, each node's services, and the readers ({name: namespaces})."""
    users: dict[str, Permissions] = {role: cluster_permissions(role) for role in CLUSTER_ROLES}
    for node in nodes:
        for role in NODE_ROLES:
            users[node_user(role, node)] = node_permissions(role, node)
    names = [DASHBOARD_READER, *(readers or {})]
    users[reader_user(DASHBOARD_READER)] = dashboard_permissions(others=names)
    for name, namespaces in (readers or {}).items():
        if name == DASHBOARD_READER:
            raise UsersError(f"reader name {name!r} is the dashboard's own; choose another name")
        users[reader_user(name)] = reader_permissions(name, namespaces, others=names)
    return users


def render_authorization(users: Mapping[str, Permissions], passwords: Mapping[str, str]) -> str:
    """The `authorization {}` block (NATS config accepts JSON values; strings stay literal)."""
    missing = sorted(set(users) - set(passwords))
    if ROUTE_USER in users:
        raise UsersError(f"{ROUTE_USER!r} is reserved for cluster routes")
    if missing:
        raise UsersError(f"no password for NATS user(s) {', '.join(missing)}")
    entries = []
    for name in sorted(users):
        entry = {"user": name, "password": passwords[name], "permissions": users[name].as_config()}
        entries.append("    " + json.dumps(entry, sort_keys=True))
    header = "# Password users (tests and local servers; deployments use `gpu-dra nats credentials`).\n"
    return header + "authorization {\n  users: [\n" + ",\n".join(entries) + "\n  ]\n}\n"


def secret_object(name: str, data: Mapping[str, str]) -> dict[str, object]:
    """A Kubernetes Secret of `data` in the driver's namespace."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "gpu-dra"}},
        "stringData": dict(data),
    }
