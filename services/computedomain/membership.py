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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from shared.bus import Bus, TypedKV, encode
from shared.events.base import now_unix
from shared.events.catalog import CD_MEMBER, CD_MEMBER_LEFT, CD_MEMBERS_BUCKET, as_token
from shared.events.computedomain import DomainMember, MemberLeft, MemberStatus
from shared.logs import get_logger

log = get_logger(__name__)

MAX_PER_CLIQUE = 18


class MembershipError(RuntimeError):
    """A node could not join (clique full, bad name); the message says what to do."""


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


def is_member_key(key: str) -> bool:
    return key.count(".") == 1


class Membership:
    """Join, update and leave domains for one node, and read or watch any domain's members."""

    def __init__(self, bus: Bus, *, max_per_clique: int = MAX_PER_CLIQUE) -> None:
        if not 1 <= max_per_clique <= 99:
            raise MembershipError(f"max_per_clique must be 1..99, not {max_per_clique}")
        self.bus = bus
        self.max_per_clique = max_per_clique
        self._typed: TypedKV[DomainMember] | None = None
        self._raw: KeyValue | None = None

    async def _kv(self) -> tuple[TypedKV[DomainMember], KeyValue]:
        if self._typed is None or self._raw is None:
            self._typed = await self.bus.kv(CD_MEMBERS_BUCKET)
            self._raw = await self.bus.js.key_value(CD_MEMBERS_BUCKET.name)
        return self._typed, self._raw

    async def _listing(self, pattern: str) -> dict[str, tuple[bytes, int]]:
        """(value, revision) of the live (non-deleted) keys matching `pattern`.

        The subjects come from the bucket stream's state (exact, unlike a watcher's end-of-replay
        marker, which can arrive before the last buffered entry); each value is then read."""
        _, raw = await self._kv()
        prefix = f"$KV.{CD_MEMBERS_BUCKET.name}."
        try:
            info = await self.bus.js.stream_info(f"KV_{CD_MEMBERS_BUCKET.name}", subjects_filter=prefix + pattern)
        except nats.errors.TimeoutError as exc:
            raise MembershipError(f"KV {CD_MEMBERS_BUCKET.name} did not answer listing {pattern}") from exc
        found: dict[str, tuple[bytes, int]] = {}
        for subject in (info.state.subjects or {}):
            key = subject[len(prefix):]
            try:
                entry = await raw.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue
            if entry.value:
                found[key] = (entry.value, int(entry.revision or 0))
        return found

    async def _entries(self, pattern: str) -> dict[str, bytes]:
        """Current (non-deleted) values of the keys matching `pattern`."""
        return {key: value for key, (value, _rev) in (await self._listing(pattern)).items()}

    async def holders(self, domain_uid: str, clique_id: str, index: str = "*") -> dict[int, str]:
        """{index: node token holding it} in a clique: per index, the live bid with the lowest revision."""
        first: dict[int, tuple[int, str]] = {}
        for key, (_value, revision) in (await self._listing(f"{index_prefix(domain_uid, clique_id)}.{index}.*")).items():
            number, node = key.rsplit(".", 2)[1:]
            if not number.isdigit():
                continue
            held = first.get(int(number))
            if held is None or revision < held[0]:
                first[int(number)] = (revision, node)
        return {number: node for number, (_rev, node) in first.items()}

    async def _reserve(self, member: DomainMember) -> int:
        """Take the lowest index nobody holds in the member's clique (bid, read back, keep or withdraw)."""
        _, raw = await self._kv()
        taken = await self.holders(member.domain_uid, member.clique_id)
        for index in range(self.max_per_clique):
            if index in taken:
                continue
            key = index_key(member.domain_uid, member.clique_id, index, member.node)
            claim = msgspec.structs.replace(member, index=index, observed_at=now_unix())
            await raw.put(key, encode(claim))
            holder = (await self.holders(member.domain_uid, member.clique_id, f"{index:02d}")).get(index)
            if holder == token(member.node):
                return index
            await raw.delete(key)  # another node bid first between our listing and our bid
        raise MembershipError(
            f"clique {member.clique_id!r} of domain {member.domain_uid} already has {self.max_per_clique} "
            f"nodes (the IMEX limit per clique); node {member.node} cannot join: shrink the workload or "
            "use a second ComputeDomain"
        )

    async def join(self, member: DomainMember) -> DomainMember:
        """Write this node's membership with an index (kept from an earlier join when still ours)."""
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
        log.info("joined compute domain", domain=member.domain_uid, node=member.node,
                 clique=member.clique_id, index=index)
        return joined

    async def set_status(self, member: DomainMember, status: MemberStatus) -> DomainMember:
        updated = msgspec.structs.replace(member, status=status, observed_at=now_unix())
        await self._write(updated)
        return updated

    async def _write(self, member: DomainMember) -> None:
        typed, _ = await self._kv()
        revision = await typed.put(member_key(member.domain_uid, member.node), member)
        await self.bus.publish(CD_MEMBER, member, msg_id=f"{member_key(member.domain_uid, member.node)}.{revision}",
                               domain_uid=token(member.domain_uid), node=token(member.node))

    async def leave(self, member: DomainMember, reason: str = "") -> None:
        """Remove this node's membership and withdraw its bid for its index (the key is its own)."""
        typed, raw = await self._kv()
        await typed.delete(member_key(member.domain_uid, member.node))
        if member.index >= 0:
            await raw.delete(index_key(member.domain_uid, member.clique_id, member.index, member.node))
        left = MemberLeft(domain_uid=member.domain_uid, node=member.node, reason=reason, observed_at=now_unix())
        await self.bus.publish(CD_MEMBER_LEFT, left, domain_uid=token(member.domain_uid), node=token(member.node))
        log.info("left compute domain", domain=member.domain_uid, node=member.node, reason=reason)

    async def members(self, domain_uid: str) -> dict[str, DomainMember]:
        """The domain's members by node name."""
        typed, _ = await self._kv()
        out: dict[str, DomainMember] = {}
        for key, raw_value in (await self._entries(f"{token(domain_uid)}.*")).items():
            member = typed.decode(key, raw_value)  # refuses a value naming another node than its key
            if member is not None:
                out[member.node] = member
        return out

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
        """Delete every key of a domain (the controller, when the domain is gone). Returns how many."""
        _, raw = await self._kv()
        keys = await self._entries(f"{token(domain_uid)}.>")
        for key in keys:
            try:
                await raw.purge(key)
            except nats.js.errors.KeyNotFoundError:
                continue
        return len(keys)

    async def watch(self, domain_uid: str | None = None) -> AsyncIterator[tuple[str, str, DomainMember | None]]:
        """(domain-token, node-token, member or None when it left); a ("", "", None) marker ends the replay."""
        typed, _ = await self._kv()
        pattern = f"{token(domain_uid)}.*" if domain_uid else "*.*"
        async for key, value in typed.watch(pattern):
            if key == "":
                yield "", "", None
                continue
            if not is_member_key(key):
                continue
            domain_token, node_token = key.split(".", 1)
            yield domain_token, node_token, value


async def wait_for_status(
    membership: Membership, domain_uid: str, node: str, status: MemberStatus, timeout: float
) -> DomainMember | None:
    """The node's member once it has `status`, or None after `timeout` seconds (watch, no polling)."""

    async def _wait() -> DomainMember:
        async for _d, node_token, member in membership.watch(domain_uid):
            if node_token == token(node) and member is not None and member.status == status:
                return member
        raise MembershipError("membership watch ended")

    try:
        return await asyncio.wait_for(_wait(), timeout)
    except TimeoutError:
        return None
