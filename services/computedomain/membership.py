"""Domain membership in NATS KV `dra-cd-members`: who is in a domain, with which DNS index.

Owns the key layout and the index allocation. Keys:
  `<domain-uid>.<node>`                          the node's DomainMember (its agent is the only writer)
  `<domain-uid>.idx.<clique-token>.<NN>.<node>`  the node's bid for index NN: its DomainMember at join
Every key a node's agent writes ends in its node, so the shipped NATS user `cd-agent.<node>` may
write exactly `*.<node>` and `*.idx.*.*.<node>` (shared/natsusers.py) and cannot write, replace or
delete another node's membership or bid. Index NN of a clique belongs to the bid with the lowest
stream sequence among its live bids: a node bids for the lowest index nobody holds, reads the bids
back, keeps the index when it is the first bidder and withdraws its bid otherwise (then tries the
next), so two nodes never hold the same index in a clique, and the holder is named by the key the
server authenticated, never by the body. At most `max_per_clique` (18) indices exist per clique. A
node that joins again keeps its index while it still holds it. Nodes without NVLink fabric (clique
"") take no index (-1). Every member write is also published on `dra.v1.cd.<uid>.member.<node>`.

  `<domain-uid>.assign.<node>`                   the controller's assignment of the domain to a node
An assignment is written by the controller alone (from the ResourceClaims allocated with a channel
of the domain on that node); no agent's NATS user can write a key of that shape. With
`require_assignment`, what this module reads and watches counts a member only while its domain is
assigned to its node: a membership written by an agent for a domain not assigned to its node is no
member (refused: counted, logged and dead-lettered `identity-mismatch`, shared.identity), so it
changes neither the domain's status nor any peer's IMEX nodes config.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue
from opentelemetry import trace

from shared import identity
from shared.bus import Bus, BusError, MsgContext, TypedKV, encode, retry_jetstream
from shared.events.base import now_unix
from shared.events.catalog import CD_MEMBER, CD_MEMBER_LEFT, CD_MEMBERS_BUCKET, as_token
from shared.events.computedomain import DomainMember, MemberLeft, MemberStatus
from shared.logs import get_logger
from shared.numbers import decimal_int

log = get_logger(__name__)

MAX_PER_CLIQUE = 18


class MembershipError(RuntimeError):
    """A node could not join (clique full, bad name); the message says what to do."""


class MembershipUnavailable(MembershipError):
    """NATS did not answer a join's read or write in time (a loaded server): the join may be tried again."""


def token(text: str) -> str:
    """`text` as one KV-key / subject token (dots and other unsafe characters become `_`)."""
    return as_token(text)


def member_key(domain_uid: str, node: str) -> str:
    return f"{token(domain_uid)}.{token(node)}"


def index_key(domain_uid: str, clique_id: str, index: int, node: str) -> str:
    """`node`'s bid for `index` in the clique."""
    return f"{index_prefix(domain_uid, clique_id)}.{index:02d}.{token(node)}"


def index_prefix(domain_uid: str, clique_id: str) -> str:
    return f"{token(domain_uid)}.idx.{token(clique_id)}"


def assignment_key(domain_uid: str, node: str) -> str:
    return f"{token(domain_uid)}.{ASSIGN}.{token(node)}"


ASSIGN = "assign"


def is_member_key(key: str) -> bool:
    return key.count(".") == 1


def _assignment_of(key: str) -> tuple[str, str] | None:
    """(domain token, node token) of an assignment key, else None."""
    parts = key.split(".")
    return (parts[0], parts[2]) if len(parts) == 3 and parts[1] == ASSIGN else None


class Membership:
    """Join, update and leave domains for one node, and read or watch any domain's members."""

    def __init__(self, bus: Bus, *, max_per_clique: int = MAX_PER_CLIQUE, require_assignment: bool = False) -> None:
        if not 1 <= max_per_clique <= 99:
            raise MembershipError(f"max_per_clique must be 1..99, not {max_per_clique}")
        self.bus = bus
        self.max_per_clique = max_per_clique
        self.require_assignment = require_assignment
        self._refused: set[tuple[str, int]] = set()  # (key, observed_at) already dead-lettered
        self._typed: TypedKV[DomainMember] | None = None
        self._raw: KeyValue | None = None

    async def _kv(self) -> tuple[TypedKV[DomainMember], KeyValue]:
        if self._typed is None or self._raw is None:
            self._typed = await self.bus.kv(CD_MEMBERS_BUCKET)
            self._raw = await retry_jetstream(  # a loaded server's timeout is retried, as bus.kv() does
                lambda: self.bus.js.key_value(CD_MEMBERS_BUCKET.name), f"open KV bucket {CD_MEMBERS_BUCKET.name}"
            )
        return self._typed, self._raw

    async def _listing(self, pattern: str) -> dict[str, tuple[bytes, int]]:
        """(value, revision) of the live (non-deleted) keys matching `pattern`.

        The subjects come from the bucket stream's state, in one answer; the values are then read, all at once."""
        _, raw = await self._kv()
        prefix = f"$KV.{CD_MEMBERS_BUCKET.name}."
        try:
            info = await self.bus.js.stream_info(f"KV_{CD_MEMBERS_BUCKET.name}", subjects_filter=prefix + pattern)
        except nats.errors.TimeoutError as exc:
            raise MembershipUnavailable(f"KV {CD_MEMBERS_BUCKET.name} did not answer listing {pattern}") from exc

        async def read(key: str) -> tuple[str, bytes, int] | None:
            try:
                entry = await raw.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                return None
            return (key, entry.value, int(entry.revision or 0)) if entry.value else None

        # the reads at once, not one after another: a clique's listing is on every joining node's path
        read_back = await asyncio.gather(*(read(subject[len(prefix) :]) for subject in info.state.subjects or {}))
        return {key: (value, revision) for key, value, revision in filter(None, read_back)}

    async def _entries(self, pattern: str) -> dict[str, bytes]:
        """Current (non-deleted) values of the keys matching `pattern`."""
        return {key: value for key, (value, _rev) in (await self._listing(pattern)).items()}

    async def _bids(self, domain_uid: str, clique_id: str, index: str = "*") -> list[tuple[int, str]]:
        """(index, node token) of the live bids in a clique, earliest (lowest revision) first; with
        `require_assignment`, only the bids of nodes the domain is assigned to."""
        assigned = await self.assigned(domain_uid) if self.require_assignment else None
        bids: list[tuple[int, int, str]] = []
        for key, (_value, revision) in (
            await self._listing(f"{index_prefix(domain_uid, clique_id)}.{index}.*")
        ).items():
            number, node = key.rsplit(".", 2)[1:]
            seat = decimal_int(number)
            if seat is not None and (assigned is None or node in assigned):
                bids.append((revision, seat, node))
        return [(number, node) for _rev, number, node in sorted(bids)]

    async def holders(self, domain_uid: str, clique_id: str, index: str = "*") -> dict[int, str]:
        """{index: node token holding it} in a clique: per index, the live bid with the lowest revision
        (with `require_assignment`, among the bids of nodes the domain is assigned to)."""
        first: dict[int, str] = {}
        for number, node in await self._bids(domain_uid, clique_id, index):
            first.setdefault(number, node)
        return first

    async def _reserve(self, member: DomainMember) -> int:
        """Take the lowest index nobody holds in the member's clique (bid, read back, keep or withdraw).

        The nodes that lost a bid to an earlier one move on in the order of their bids, each to a
        different one of the next free indices (the second bidder to the next, the third to the one
        after), not all to the next one again: nodes joining at once take one round or two, not one per
        node. A pass that ends without an index (its skipped index was not taken after all) starts over."""
        _, raw = await self._kv()
        me = token(member.node)
        for _pass in range(self.max_per_clique):
            taken = await self.holders(member.domain_uid, member.clique_id)
            ours = sorted(index for index, node in taken.items() if node == me)
            if ours:  # a join cut short (a timeout) after its bid won: that index is ours
                return ours[0]
            if len(taken) >= self.max_per_clique:
                break
            skip = 0
            for index in range(self.max_per_clique):
                if index in taken:
                    continue
                if skip:
                    skip -= 1
                    continue
                key = index_key(member.domain_uid, member.clique_id, index, member.node)
                claim = msgspec.structs.replace(member, index=index, observed_at=now_unix())
                await raw.put(key, encode(claim))
                bidders = [node for _n, node in await self._bids(member.domain_uid, member.clique_id, f"{index:02d}")]
                if bidders[:1] == [me]:
                    return index
                await raw.delete(key)  # another node bid first between our listing and our bid
                skip = bidders.index(me) - 1 if me in bidders else 0
        raise MembershipError(
            f"clique {member.clique_id!r} of domain {member.domain_uid} already has {self.max_per_clique} "
            f"nodes (the IMEX limit per clique); node {member.node} cannot join: shrink the workload or "
            "use a second ComputeDomain"
        )

    async def join(self, member: DomainMember) -> DomainMember:
        """Write this node's membership with an index (kept from an earlier join when still ours).
        MembershipUnavailable when NATS does not answer in time: a join tried again keeps what this one
        got as far as (its bid holds its index, `_reserve`)."""
        try:
            return await self._join(member)
        except (nats.errors.TimeoutError, BusError) as exc:
            raise MembershipUnavailable(
                f"KV {CD_MEMBERS_BUCKET.name} did not answer node {member.node}'s join: {exc}"
            ) from exc

    async def _join(self, member: DomainMember) -> DomainMember:
        typed, _ = await self._kv()
        if member.clique_id == "":
            index = -1
        else:
            index = -1
            previous = await typed.get(member_key(member.domain_uid, member.node))
            if previous is not None and previous.clique_id == member.clique_id and previous.index >= 0:
                held = await self.holders(member.domain_uid, member.clique_id, f"{previous.index:02d}")
                if held.get(previous.index) == token(member.node):
                    index = previous.index
            if index < 0:
                index = await self._reserve(member)
        joined = msgspec.structs.replace(member, index=index, observed_at=now_unix())
        await self._write(joined)
        log.info(
            "joined compute domain", domain=member.domain_uid, node=member.node, clique=member.clique_id, index=index
        )
        return joined

    async def set_status(self, member: DomainMember, status: MemberStatus) -> DomainMember:
        updated = msgspec.structs.replace(member, status=status, observed_at=now_unix())
        await self._write(updated)
        return updated

    async def _write(self, member: DomainMember) -> None:
        typed, _ = await self._kv()
        revision = await typed.put(member_key(member.domain_uid, member.node), member)
        await self.bus.publish(
            CD_MEMBER,
            member,
            msg_id=f"{member_key(member.domain_uid, member.node)}.{revision}",
            domain_uid=token(member.domain_uid),
            node=token(member.node),
        )

    async def leave(self, member: DomainMember, reason: str = "") -> None:
        """Remove this node's membership and withdraw its bid for its index (the key is its own)."""
        typed, raw = await self._kv()
        await typed.delete(member_key(member.domain_uid, member.node))
        if member.index >= 0:
            await raw.delete(index_key(member.domain_uid, member.clique_id, member.index, member.node))
        left = MemberLeft(domain_uid=member.domain_uid, node=member.node, reason=reason, observed_at=now_unix())
        await self.bus.publish(CD_MEMBER_LEFT, left, domain_uid=token(member.domain_uid), node=token(member.node))
        log.info("left compute domain", domain=member.domain_uid, node=member.node, reason=reason)

    async def member(self, domain_uid: str, node: str) -> DomainMember | None:
        """The node's member of the domain as stored now (a direct get of its key); None: not a member (with
        `require_assignment`, also while the domain is not assigned to the node)."""
        typed, _ = await self._kv()
        if self.require_assignment and token(node) not in await self.assigned(domain_uid):
            return None
        return await typed.get(member_key(domain_uid, node))

    async def members(self, domain_uid: str) -> dict[str, DomainMember]:
        """The domain's members by node name."""
        typed, _ = await self._kv()
        assigned = await self.assigned(domain_uid) if self.require_assignment else None
        out: dict[str, DomainMember] = {}
        for key, raw_value in (await self._entries(f"{token(domain_uid)}.*")).items():
            member = typed.decode(key, raw_value)  # refuses a value naming another node than its key
            if member is None:
                continue
            if assigned is not None and key.split(".", 1)[1] not in assigned:
                await self._refuse_unassigned(key, member)
                continue
            out[member.node] = member
        return out

    # ---- assignments (the controller's) ------------------------------------------------------

    async def assign(self, domain_uid: str, node: str, claims: list[str]) -> None:
        """Assign the domain to `node` (the controller: a claim with its channel is allocated there)."""
        _, raw = await self._kv()
        await raw.put(assignment_key(domain_uid, node), msgspec.json.encode({"claims": sorted(claims)}))
        log.info("compute domain assigned to node", domain=domain_uid, node=node, claims=len(claims))

    async def unassign(self, domain_uid: str, node: str) -> None:
        _, raw = await self._kv()
        await raw.delete(assignment_key(domain_uid, node))
        log.info("compute domain no longer assigned to node", domain=domain_uid, node=node)

    async def assigned(self, domain_uid: str) -> set[str]:
        """The node tokens the domain is assigned to."""
        return {key.rsplit(".", 1)[1] for key in await self._entries(f"{token(domain_uid)}.{ASSIGN}.*")}

    async def assignments(self) -> set[tuple[str, str]]:
        """Every (domain token, node token) assignment."""
        return {pair for key in await self._entries(f"*.{ASSIGN}.*") if (pair := _assignment_of(key))}

    async def _refuse_unassigned(self, key: str, member: DomainMember) -> None:
        """A membership for a domain the controller did not assign to its node: no member, dead-lettered once."""
        if (key, int(member.observed_at)) in self._refused:
            return
        self._refused.add((key, int(member.observed_at)))
        mismatch = identity.Mismatch(
            CD_MEMBERS_BUCKET.name,
            f"$KV.{CD_MEMBERS_BUCKET.name}.{key}",
            (("domain_uid", f"not assigned to node {member.node}", member.domain_uid),),
        )
        await self.bus.refuse(mismatch, encode(member), self.bus.name)

    async def node_memberships(self, node: str) -> list[DomainMember]:
        """Every domain this node is recorded in (an agent resuming after a restart)."""
        typed, _ = await self._kv()
        out: list[DomainMember] = []
        for key, raw_value in (await self._entries(f"*.{token(node)}")).items():
            member = typed.decode(key, raw_value)
            if member is not None:
                out.append(member)
        return out

    async def purge_domain(self, domain_uid: str) -> int:
        """Delete every key of a domain (the controller, when the domain is gone). Returns how many.

        A delete marker per key, which watchers see: the bucket refuses the rollup header a KV purge
        sends (a `Nats-Rollup: all` would erase every domain's keys)."""
        _, raw = await self._kv()
        keys = await self._entries(f"{token(domain_uid)}.>")
        for key in keys:
            try:
                await raw.delete(key)
            except nats.js.errors.KeyNotFoundError:
                continue
        return len(keys)

    async def watch(self, domain_uid: str | None = None) -> AsyncIterator[tuple[str, str, DomainMember | None]]:
        """(domain-token, node-token, member or None when it left); a ("", "", None) marker ends the replay."""
        typed, _ = await self._kv()
        if self.require_assignment:
            async for item in self._watch_assigned(typed, domain_uid):
                yield item
            return
        pattern = f"{token(domain_uid)}.*" if domain_uid else "*.*"
        async for key, value in typed.watch(pattern):
            if key == "":
                yield "", "", None
                continue
            if not is_member_key(key):
                continue
            domain_token, node_token = key.split(".", 1)
            yield domain_token, node_token, value

    async def _watch_assigned(
        self, typed: TypedKV[DomainMember], domain_uid: str | None
    ) -> AsyncIterator[tuple[str, str, DomainMember | None]]:
        """watch() counting a member only while its domain is assigned to its node. Members and
        assignments come in any order: an unassigned member is held (refused once), and shown when
        its assignment arrives; an assignment withdrawn takes its member away."""
        assigned: set[tuple[str, str]] = set()
        written: dict[tuple[str, str], DomainMember] = {}  # every member key's value, assigned or not
        shown: set[tuple[str, str]] = set()
        replayed = False
        pattern = f"{token(domain_uid)}.>" if domain_uid else ">"
        watcher = await typed.open_watch(pattern)
        try:
            async for entry in typed.updates(watcher):
                if entry is None:
                    for pair in sorted(written):
                        if pair in assigned:
                            shown.add(pair)
                            yield pair[0], pair[1], written[pair]
                        else:
                            await self._refuse_unassigned(".".join(pair), written[pair])
                    replayed = True
                    yield "", "", None
                    continue
                gone = entry.operation in ("DEL", "PURGE") or not entry.value
                assignment = _assignment_of(entry.key)
                if assignment is not None:
                    if gone:
                        assigned.discard(assignment)
                        if assignment in shown:
                            shown.discard(assignment)
                            yield assignment[0], assignment[1], None
                    else:
                        assigned.add(assignment)
                        if replayed and assignment in written and assignment not in shown:
                            shown.add(assignment)
                            yield assignment[0], assignment[1], written[assignment]
                    continue
                if not is_member_key(entry.key):
                    continue
                domain_token, node_token = entry.key.split(".", 1)
                pair = (domain_token, node_token)
                member = None if gone else typed.accepted(entry.key, entry.value, int(entry.revision or 0))
                if member is None and not gone:
                    continue  # refused (relayed, undecodable, another identity's): the last good value stands
                if member is None:
                    written.pop(pair, None)
                    if pair in shown:
                        shown.discard(pair)
                        yield domain_token, node_token, None
                    continue
                written[pair] = member
                if not replayed:
                    continue
                if pair in assigned:
                    shown.add(pair)
                    yield domain_token, node_token, member
                else:
                    await self._refuse_unassigned(entry.key, member)
        finally:
            await watcher.stop()

    def consume(self, domain_token: str, node_token: str) -> contextlib.AbstractContextManager[trace.Span]:
        """A consumer span for a member change that watch() yielded: the child of the agent's write of it."""
        if self._typed is None:
            raise MembershipError("consume() needs a watch() running")
        return self._typed.consume(f"{domain_token}.{node_token}")


async def wait_for_status(
    membership: Membership, domain_uid: str, node: str, status: MemberStatus, timeout: float
) -> DomainMember | None:
    """The node's member once it has `status`, or None after `timeout` seconds. No polling and no consumer: the
    node's member events (every write of its key publishes one; a core subscription here) say when, and its key
    is read before the first (what was written before) and once more at the end (an event missed while the
    connection was away). A KV watch of the domain, as before, was one more consumer on the members bucket for
    each node preparing, kept 5 minutes after, and delivered every peer's changes to each of them."""
    reached: asyncio.Future[DomainMember] = asyncio.get_running_loop().create_future()

    async def on_member(member: DomainMember, _ctx: MsgContext) -> None:
        if member.status != status or reached.done():
            return
        if membership.require_assignment and token(node) not in await membership.assigned(domain_uid):
            return
        if not reached.done():
            reached.set_result(member)

    sub = await membership.bus.subscribe(CD_MEMBER, on_member, domain_uid=token(domain_uid), node=token(node))
    try:
        member = await membership.member(domain_uid, node)
        if member is not None and member.status == status:
            return member
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(reached, timeout)
        member = await membership.member(domain_uid, node)
        return member if member is not None and member.status == status else None
    finally:
        await membership.bus.unsubscribe(sub)
