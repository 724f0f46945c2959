"""Node ownership among publisher replicas: rendezvous hashing and heartbeats over a real nats-server."""

from __future__ import annotations

import asyncio

from services.publisher.ownership import Membership, owner_of
from shared.bus import Bus

NODES = [f"node-{i}" for i in range(200)]


def test_every_node_has_exactly_one_owner_and_a_new_replica_moves_only_its_share():
    two = {"a", "b"}
    owners = {n: owner_of(n, two) for n in NODES}
    assert set(owners.values()) == two
    assert 60 < sum(1 for o in owners.values() if o == "a") < 140
    three = {n: owner_of(n, two | {"c"}) for n in NODES}
    moved = [n for n in NODES if three[n] != owners[n]]
    assert all(three[n] == "c" for n in moved)  # nothing moves between a and b
    assert owner_of("node-1", set()) is None


def test_moved_nodes_are_those_whose_owner_changed_for_departures_arrivals_and_both():
    """Membership.moved() takes shortcuts (a departure moves only the departed replica's nodes, an arrival only
    the nodes a newcomer outscores): its answer is what owner_of says of each set, with or without the owners
    of the set before remembered."""
    for before, after in (
        (frozenset("abcd"), frozenset("abc")),  # a departure
        (frozenset("abc"), frozenset("abcd")),  # an arrival
        (frozenset("abc"), frozenset("acd")),  # both at once
        (frozenset(), frozenset("ab")),
    ):
        for me in sorted(before | after):
            member = Membership(None, me)  # type: ignore[arg-type]  # no bus: moved() computes only
            want = (
                [n for n in NODES if owner_of(n, after) == me and owner_of(n, before) != me],
                [n for n in NODES if owner_of(n, before) == me and owner_of(n, after) != me],
            )
            assert member.moved(NODES, before, after) == want  # nothing remembered of `before`
            member.live = before
            asked = [member.owns(n) for n in NODES]  # the owners among `before`, remembered
            assert asked == [owner_of(n, before) == me for n in NODES]
            member.live = after
            member._previous, member._owners = member._owners, (after, {})  # noqa: SLF001 - as _recompute does
            assert member.moved(NODES, before, after) == want
            assert [member.owns(n) for n in NODES] == [owner_of(n, after) == me for n in NODES]


async def _member(url: str, replica: str, lease_s: float = 0.6) -> tuple[Bus, Membership]:
    bus = await Bus.connect(url, name=f"test-{replica}")
    await bus.provision()
    member = Membership(bus, replica, heartbeat_s=0.1, lease_s=lease_s)
    await member.start()
    return bus, member


async def test_replicas_share_nodes_and_hand_over_on_stop_and_on_crash(nats_server):
    bus_a, a = await _member(nats_server.url, "a")
    bus_b, b = await _member(nats_server.url, "b")
    bus_c = None
    try:
        await asyncio.wait_for(asyncio.gather(a.wait_for({"a", "b"}), b.wait_for({"a", "b"})), 5)
        owned_a = {n for n in NODES if a.owns(n)}
        owned_b = {n for n in NODES if b.owns(n)}
        assert owned_a and owned_b and owned_a.isdisjoint(owned_b) and owned_a | owned_b == set(NODES)

        await b.stop(clean=True)  # a clean stop deletes the heartbeat: the handover is immediate
        await asyncio.wait_for(a.wait_for({"a"}), 1.0)
        assert all(a.owns(n) for n in NODES)

        bus_c, c = await _member(nats_server.url, "c")
        await asyncio.wait_for(a.wait_for({"a", "c"}), 5)
        await c.stop(clean=False)  # a crash: the heartbeat just stops
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(a.wait_for({"a"}), 5)
        assert loop.time() - started < 0.6 + 0.5  # within the lease (plus one expiry tick)
        assert all(a.owns(n) for n in NODES)
    finally:
        await a.stop()
        for bus in (bus_a, bus_b, bus_c):
            if bus is not None:
                await bus.close()


async def test_a_stale_heartbeat_from_a_dead_replica_is_not_counted(nats_server):
    bus_old, old = await _member(nats_server.url, "old", lease_s=0.3)
    await old.stop(clean=False)
    await bus_old.close()
    await asyncio.sleep(0.4)  # let the left-behind heartbeat age past the lease (a clock, not an event)
    bus_new, new = await _member(nats_server.url, "new", lease_s=0.3)
    try:
        assert new.live == {"new"}
    finally:
        await new.stop()
        await bus_new.close()
