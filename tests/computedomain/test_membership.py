"""Membership in NATS KV: lowest free index per clique, compare-and-set, the 18-node limit."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from services.computedomain.membership import Membership, MembershipError, index_key, member_key, wait_for_status
from shared.bus import Bus
from shared.events.catalog import CD_MEMBERS_BUCKET
from shared.events.computedomain import DomainMember

CLIQUE_A = "6f2a9c1e-3b4d-5e6f-8a9b-0c1d2e3f4a5b.1"
CLIQUE_B = "6f2a9c1e-3b4d-5e6f-8a9b-0c1d2e3f4a5b.2"


def member(node: str, clique: str = CLIQUE_A, uid: str = "uid-1") -> DomainMember:
    return DomainMember(
        domain_uid=uid,
        domain_name="cd",
        domain_namespace="ns",
        node=node,
        ip_address="127.0.0.1",
        clique_id=clique,
        index=-1,
    )


@pytest.fixture
async def buses(nats_server):
    opened = [await Bus.connect(nats_server.url, name=f"agent-{i}") for i in range(4)]
    await opened[0].provision()
    try:
        yield opened
    finally:
        for bus in opened:
            await bus.close()


async def test_concurrent_joins_get_distinct_lowest_indices_and_the_19th_is_refused(buses):
    # 18 nodes over 4 separate connections join at once: every index 0..17 exactly once.
    memberships = [Membership(bus) for bus in buses]
    joined = await asyncio.gather(*(memberships[i % 4].join(member(f"n{i}")) for i in range(18)))
    assert sorted(m.index for m in joined) == list(range(18))
    with pytest.raises(MembershipError, match="already has 18 nodes"):
        await memberships[0].join(member("n18"))
    # another clique has its own 0..17
    other = await memberships[1].join(member("b0", CLIQUE_B))
    assert other.index == 0
    assert len(await memberships[2].members("uid-1")) == 19


async def test_rejoin_keeps_index_and_leave_frees_the_lowest(buses):
    ms = Membership(buses[0])
    a = await ms.join(member("a"))
    b = await ms.join(member("b"))
    c = await ms.join(member("c"))
    assert (a.index, b.index, c.index) == (0, 1, 2)
    again = await ms.join(member("b"))  # an agent restart joins again
    assert again.index == 1
    await ms.leave(b)
    assert set(await ms.members("uid-1")) == {"a", "c"}
    d = await ms.join(member("d"))
    assert d.index == 1  # the lowest free index
    assert (await ms.members("uid-1"))["d"].index == 1


async def test_non_fabric_nodes_take_no_index_and_purge_removes_every_key(buses):
    ms = Membership(buses[0])
    plain = await ms.join(member("cpu", clique=""))
    assert plain.index == -1
    await ms.join(member("a"))
    await ms.join(member("x", uid="uid-2"))
    assert await ms.purge_domain("uid-1") >= 3  # two members and one reservation
    assert await ms.members("uid-1") == {}
    kv = await buses[0].kv(__import__("shared.events.catalog", fromlist=["x"]).CD_MEMBERS_BUCKET)
    assert await kv.get(index_key("uid-1", CLIQUE_A, 0, "a")) is None
    assert await kv.get(member_key("uid-2", "x")) is not None  # other domains untouched


async def test_watch_replays_then_follows_changes(buses):
    ms = Membership(buses[0])
    await ms.join(member("a"))
    seen: list[tuple[str, str | None]] = []
    marker = asyncio.Event()

    async def follow() -> None:
        async for _d, node, value in ms.watch("uid-1"):
            if node == "":
                marker.set()
                continue
            seen.append((node, value.status if value else None))
            if len(seen) == 3:
                return

    task = asyncio.create_task(follow())
    await marker.wait()
    b = await Membership(buses[1]).join(member("b"))
    await Membership(buses[1]).set_status(b, "Ready")
    await asyncio.wait_for(task, 5)
    assert seen == [("a", "NotReady"), ("b", "NotReady"), ("b", "Ready")]


async def test_nodes_that_lose_a_bid_spread_over_the_next_indices(buses):
    # 18 nodes joining at once used to bid for one index after the other together: the last one bid 18
    # times (171 bids in all). Losers now move on in their bids' order, each to a different free index:
    # 35-106 bids in 15 runs (views differ across the 4 connections, so some still collide).
    bids: list[str] = []

    class Counting(Membership):
        async def _bids(self, domain_uid: str, clique_id: str, index: str = "*") -> list[tuple[int, str]]:
            if index != "*":
                bids.append(index)  # the read-back after a bid
            return await super()._bids(domain_uid, clique_id, index)

    memberships = [Counting(bus) for bus in buses]
    joined = await asyncio.gather(*(memberships[i % 4].join(member(f"n{i}")) for i in range(18)))
    assert sorted(m.index for m in joined) == list(range(18))
    assert len(bids) <= 130, f"{len(bids)} bids for 18 nodes"


class _ReadsKnown(Membership):
    """A membership that says when it has read a member (the waiter's read before any event came)."""

    def __init__(self, bus: Bus) -> None:
        super().__init__(bus)
        self.read = asyncio.Event()

    async def member(self, domain_uid: str, node: str) -> DomainMember | None:
        found = await super().member(domain_uid, node)
        self.read.set()
        return found


async def _consumers(bus: Bus) -> int:
    return int((await bus.js.stream_info(f"KV_{CD_MEMBERS_BUCKET.name}")).state.consumer_count or 0)


async def test_a_wait_for_ready_is_woken_by_the_member_event_and_holds_no_consumer(buses):
    """A preparing node waited by a KV watch of its whole domain: one more consumer on the members bucket per
    node (kept 5 minutes after), every peer's change delivered to it. Now its node's member events wake it."""
    agent = Membership(buses[0])
    joined = await agent.join(member("a"))
    before = await _consumers(buses[0])
    waiting = _ReadsKnown(buses[1])
    waiter = asyncio.create_task(wait_for_status(waiting, "uid-1", "a", "Ready", timeout=60))
    await waiting.read.wait()  # it read NotReady: only the event can end the wait before its 60 s
    assert not waiter.done()
    assert await _consumers(buses[0]) == before
    await agent.set_status(joined, "Ready")
    ready = await asyncio.wait_for(waiter, 10)
    assert ready is not None and ready.node == "a" and ready.status == "Ready"
    assert await _consumers(buses[0]) == before
    # already Ready: the first read answers; never Ready: None after the timeout
    assert await wait_for_status(Membership(buses[2]), "uid-1", "a", "Ready", timeout=5) is not None
    assert await wait_for_status(Membership(buses[2]), "uid-1", "a", "NotReady", timeout=0.2) is None


async def test_a_join_tried_again_after_a_timeout_keeps_the_index_its_bid_won(buses):
    ms = Membership(buses[0])
    assert (await ms.join(member("a"))).index == 0
    # node b's first join bid for index 1, won it, and timed out before it wrote its membership
    raw = await buses[1].js.key_value(CD_MEMBERS_BUCKET.name)
    bid = DomainMember(**{**msgspec.structs.asdict(member("b")), "index": 1})
    await raw.put(index_key("uid-1", CLIQUE_A, 1, "b"), msgspec.json.encode(bid))
    assert (await ms.join(member("c"))).index == 2
    again = await Membership(buses[1]).join(member("b"))  # the kubelet's retry
    assert again.index == 1
    assert await ms.holders("uid-1", CLIQUE_A) == {0: "a", 1: "b", 2: "c"}
    listed = await (await buses[1].kv(CD_MEMBERS_BUCKET)).keys()
    assert [k for k in listed if ".idx." in k and k.endswith(".b")] == [index_key("uid-1", CLIQUE_A, 1, "b")]
