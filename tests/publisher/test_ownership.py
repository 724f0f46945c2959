"""Node ownership among publisher replicas: rendezvous hashing, heartbeats and presence probes over a real
nats-server, with replicas in processes of their own killed and stopped by signals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from services.publisher.ownership import REPLICAS_LOST, Membership, owner_of, presence_subject
from shared import presence
from shared.bus import Bus
from tests.polling import eventually

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


async def _member(url: str, replica: str, lease_s: float = 0.6, probe_s: float = 0.5) -> tuple[Bus, Membership]:
    bus = await Bus.connect(url, name=f"test-{replica}")
    await bus.provision()
    member = Membership(bus, replica, heartbeat_s=0.1, lease_s=lease_s, probe_s=probe_s)
    await member.start()
    return bus, member


REPO = Path(__file__).resolve().parents[2]
# One replica in a process of its own: beats, watches and answers probes until it is signalled.
_REPLICA = """
import asyncio, sys
from services.publisher.ownership import Membership
from shared.bus import Bus

async def main():
    bus = await Bus.connect(sys.argv[1], name="test-" + sys.argv[2])
    member = Membership(bus, sys.argv[2], heartbeat_s=0.1, lease_s=float(sys.argv[3]))
    await member.start()
    print("started", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@contextlib.asynccontextmanager
async def _replica_process(url: str, replica: str, lease_s: float) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _REPLICA, url, replica, str(lease_s), cwd=REPO, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"started\n"
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def _lost(seen_by: str) -> float:
    return REPLICAS_LOST.labels(seen_by)._value.get()  # noqa: SLF001 - prometheus_client's counter value


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


async def test_a_killed_replica_is_gone_once_its_connection_is_long_before_its_lease(nats_server):
    """SIGKILL ends the replica's connection, and with it its presence subscription: the survivor's probes get
    the server's no-responders answer and move its nodes within two probes, where the lease is 30 s."""
    lease = 30.0
    bus_a, a = await _member(nats_server.url, "a", lease_s=lease, probe_s=0.1)
    try:
        async with _replica_process(nats_server.url, "b", lease) as b:
            await asyncio.wait_for(a.wait_for({"a", "b"}), 10)
            assert await presence.probe(bus_a.nc, presence_subject("b"), 5.0) is True
            by_connection = _lost("connection")
            loop = asyncio.get_running_loop()
            killed = loop.time()
            b.send_signal(signal.SIGKILL)
            await asyncio.wait_for(a.wait_for({"a"}), 10)
            assert loop.time() - killed < 5.0  # a sixth of the lease: no heartbeat ran out
            assert _lost("connection") == by_connection + 1
            assert all(a.owns(n) for n in NODES)
    finally:
        await a.stop()
        await bus_a.close()


async def test_a_replica_on_a_busy_loop_still_sees_a_killed_peer_gone_before_its_lease(nats_server):
    """A survivor starved of CPU (its loop blocked 0.3 s at a time, three probe periods) reads the server's
    no-responders answer late; late, it is still no answer from the peer, not a timeout."""
    lease = 30.0
    bus_a, a = await _member(nats_server.url, "a", lease_s=lease, probe_s=0.1)

    async def hog() -> None:
        while True:
            time.sleep(0.3)  # noqa: ASYNC251 - blocking on purpose: a loop with no time to spare
            await asyncio.sleep(0)

    try:
        async with _replica_process(nats_server.url, "b", lease) as b:
            await asyncio.wait_for(a.wait_for({"a", "b"}), 10)
            busy = asyncio.create_task(hog())
            try:
                loop = asyncio.get_running_loop()
                killed = loop.time()
                b.send_signal(signal.SIGKILL)
                await asyncio.wait_for(a.wait_for({"a"}), 20)
                assert loop.time() - killed < 10.0  # a third of the lease
            finally:
                busy.cancel()
    finally:
        await a.stop()
        await bus_a.close()


async def test_a_replica_killed_while_paused_is_gone_before_the_probes_it_never_answered_time_out(nats_server):
    """Probes sent while the peer is paused wait (up to a lease) for an answer that never comes; once it is killed,
    the next probes get the server's no-responders and it is gone long before those time out."""
    lease = 30.0
    bus_a, a = await _member(nats_server.url, "a", lease_s=lease, probe_s=0.1)
    try:
        async with _replica_process(nats_server.url, "b", lease) as b:
            await asyncio.wait_for(a.wait_for({"a", "b"}), 10)
            os.kill(b.pid, signal.SIGSTOP)

            async def unanswered() -> bool:  # probes out for longer than a probe period: b took them, answers none
                return len(a._asking.get("b", ())) >= 3  # noqa: SLF001

            await eventually(unanswered, "probes b holds unanswered", timeout=10)
            loop = asyncio.get_running_loop()
            killed = loop.time()
            b.send_signal(signal.SIGKILL)
            await asyncio.wait_for(a.wait_for({"a"}), 20)
            assert loop.time() - killed < 10.0  # a third of the lease those first probes wait
    finally:
        await a.stop()
        await bus_a.close()


async def test_a_paused_replica_keeps_its_nodes_until_its_lease_runs_out(nats_server):
    """SIGSTOP leaves the connection open: probes go unanswered (time out), which proves nothing, so the paused
    replica's nodes stay its own until its lease passes without a heartbeat."""
    lease = 2.0
    bus_a, a = await _member(nats_server.url, "a", lease_s=lease, probe_s=0.1)
    try:
        async with _replica_process(nats_server.url, "b", lease) as b:
            await asyncio.wait_for(a.wait_for({"a", "b"}), 10)
            by_lease, by_connection = _lost("lease"), _lost("connection")
            loop = asyncio.get_running_loop()
            stopped = loop.time()
            os.kill(b.pid, signal.SIGSTOP)
            await asyncio.wait_for(a.wait_for({"a"}), 10)
            assert loop.time() - stopped >= lease - 0.1 - 0.05  # its last beat came at most a heartbeat before
            assert (_lost("lease"), _lost("connection")) == (by_lease + 1, by_connection)
    finally:
        await a.stop()
        await bus_a.close()


async def test_a_replica_whose_probes_go_unanswered_after_a_reconnect_keeps_its_nodes_for_a_lease(nats_server):
    """Right after this replica's own reconnect its peers may still be on their way back: a peer nobody answers
    for then is not taken for gone before its lease."""
    lease = 2.0
    bus_a, a = await _member(nats_server.url, "a", lease_s=lease, probe_s=0.1)
    try:
        async with _replica_process(nats_server.url, "b", lease) as b:
            await asyncio.wait_for(a.wait_for({"a", "b"}), 10)
            by_lease = _lost("lease")
            bus_a.notify_reconnected()
            loop = asyncio.get_running_loop()
            killed = loop.time()
            b.send_signal(signal.SIGKILL)
            await asyncio.wait_for(a.wait_for({"a"}), 10)
            assert loop.time() - killed >= lease - 0.1 - 0.05
            assert _lost("lease") == by_lease + 1
    finally:
        await a.stop()
        await bus_a.close()


async def test_a_peer_taken_for_gone_comes_back_only_once_it_answers_again(nats_server):
    """A peer whose presence went unanswered while its heartbeats went on (a connection that came back) is
    gone; its heartbeats, which may be ones sent before it died, do not bring it back; an answer does."""
    bus_a, a = await _member(nats_server.url, "a", lease_s=30.0, probe_s=0.1)
    bus_b, b = await _member(nats_server.url, "b", lease_s=30.0, probe_s=0)
    try:
        await asyncio.wait_for(a.wait_for({"a", "b"}), 10)
        answering = b._answering  # noqa: SLF001
        assert answering is not None
        await answering.unsubscribe()  # what a lost connection does to it
        await asyncio.wait_for(a.wait_for({"a"}), 10)
        observe, beats_seen = a._observe, asyncio.Queue[str]()  # noqa: SLF001 - a's KV watch hands it each beat

        def observed(key: str, beat: Any) -> None:
            observe(key, beat)
            beats_seen.put_nowait(key)

        a._observe = observed  # type: ignore[method-assign]  # noqa: SLF001
        for _ in range(3):  # b beats on: a's watch hands a its beats, and a does not count them
            while await asyncio.wait_for(beats_seen.get(), 10) != "b":
                pass
            assert a.live == {"a"}
        b._answering = await presence.answer(bus_b.nc, presence_subject("b"))  # noqa: SLF001 - it answers again
        await asyncio.wait_for(a.wait_for({"a", "b"}), 10)
    finally:
        await a.stop()
        await b.stop()
        await bus_a.close()
        await bus_b.close()


def test_a_name_that_is_not_one_subject_token_gets_a_subject_of_its_own():
    assert presence_subject("pub-1") == "dra.v1.presence.publisher.pub-1"
    dotted, underscored = presence_subject("host.a-1"), presence_subject("host_a-1")
    assert dotted != underscored and dotted.startswith("dra.v1.presence.publisher.host_a-1-")
    assert dotted.count(".") == underscored.count(".") == 4
