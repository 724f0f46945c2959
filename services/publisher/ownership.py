"""Which publisher replica owns which node: heartbeats in a JetStream KV bucket, rendezvous hashing.

Each replica puts a heartbeat under its id every `heartbeat_s`; every replica watches the bucket
and counts a peer as live while its last heartbeat is younger than `lease_s` by the watcher's own
monotonic clock (no clock skew between hosts matters). A node belongs to the live replica with the
highest hash of (node, replica), so a membership change moves only the nodes it must. A replica
that stops cleanly deletes its key, and its nodes move at once. One that dies is seen gone when
its NATS connection is: every replica answers on its presence subject and probes its peers' every
`probe_s` (shared.presence); a peer the server twice says nobody answers for, with no answer from
it between, is gone long before its lease runs out. A peer that is slow or paused still answers or
times out; it keeps its nodes until `lease_s` passes without a heartbeat. The last values stay in
KV, so the new owner converges without a replay (no gap).
Two replicas may briefly both act on a node while views differ; writes carry resourceVersion
preconditions and content hashes, so the overlap costs a conflict, not a wrong slice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import time
from collections.abc import Callable, Iterable
from typing import Any

from nats.aio.subscription import Subscription
from prometheus_client import Counter, Gauge

from shared import presence
from shared.bus import Bus, TypedKV
from shared.events.base import Message
from shared.events.catalog import PUBLISHER_PRESENCE_SUBJECT, Bucket
from shared.logs import get_logger
from shared.tasks import cancel_and_wait

log = get_logger(__name__)
LIVE_REPLICAS = Gauge(
    "gpu_dra_publisher_live_replicas", "Publisher replicas this one sees alive (they share the nodes)"
)
REPLICAS_LOST = Counter(
    "gpu_dra_publisher_replicas_lost",
    "Peer replicas this one took for gone: their connection gone (a probe) or their lease run out",
    ["seen_by"],
)
# no-responder answers, with no answer between, that make a peer gone (one could race an interest update)
PROBE_MISSES = 2


class ReplicaHeartbeat(Message, kw_only=True):
    """One publisher replica saying it is alive."""

    replica: str
    started_at: float
    beat_at: float
    seq: int = 0


REPLICAS_BUCKET = Bucket("dra-publisher-replicas", ReplicaHeartbeat)


def score(node: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{node}\0{replica}".encode(), digest_size=8).digest(), "big")


def owner_of(node: str, replicas: frozenset[str] | set[str]) -> str | None:
    """The replica that owns `node` among `replicas` (rendezvous hashing); None when there are none."""
    if not replicas:
        return None
    return max(replicas, key=lambda r: (score(node, r), r))


class Membership:
    """This replica's view of the live publishers; `owns(node)` answers from it."""

    def __init__(
        self,
        bus: Bus,
        replica: str,
        *,
        heartbeat_s: float = 1.0,
        lease_s: float = 5.0,
        probe_s: float = 0.5,
        on_change: Callable[[frozenset[str], frozenset[str]], None] | None = None,
    ) -> None:
        self.bus = bus
        self.replica = replica
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s
        self.probe_s = probe_s  # 0: no probes, a dead peer is gone after its lease only
        self.on_change = on_change
        self.live: frozenset[str] = frozenset({replica})
        self._seen: dict[str, float] = {}
        self._misses: dict[str, int] = {}  # peer -> no-responder answers since its last answer
        # peer -> when (monotonic) a probe found it gone: its heartbeats still on their way are not counted
        # until a probe finds it connected again
        self._gone: dict[str, float] = {}
        self._asking: dict[str, set[asyncio.Future[bool | None]]] = {}  # peer -> its probes still out
        self._probes_from = 0.0  # (monotonic) no probe counts before: peers may still be reconnecting
        self._answering: Subscription | None = None  # this replica's presence subscription
        self._tasks: list[asyncio.Task[None]] = []
        self._started = time.time()
        self._seq = 0
        self._kv: TypedKV[Any] | None = None
        self._synced = asyncio.Event()
        self._changed = asyncio.Event()
        # node -> its owner, for the live set it was worked out for: a node's hashes once per membership change,
        # not on every look (a cold start at 65,000 nodes asked ~8 times a node: 4% of its CPU)
        self._owners: tuple[frozenset[str], dict[str, str | None]] = (self.live, {})
        # the same for the live set before the last change: where a change's moved nodes were owned
        self._previous: tuple[frozenset[str], dict[str, str | None]] = (frozenset(), {})

    def owner(self, node: str) -> str | None:
        live, known = self._owners
        if live is not self.live:
            live, known = self._owners = (self.live, {})
        if node in known:
            return known[node]
        known[node] = found = owner_of(node, live)
        return found

    def owns(self, node: str) -> bool:
        return self.owner(node) == self.replica

    def moved(self, nodes: Iterable[str], before: frozenset[str], after: frozenset[str]) -> tuple[list[str], list[str]]:
        """(gained, lost): the `nodes` this replica owns among `after` and did not among `before`, and the other
        way round. Rendezvous hashing moves only the nodes it must: when replicas leave, only theirs move (to
        the replica scoring next); when replicas join, only the nodes a newcomer outscores. So a departure at
        65,000 nodes hashes the departed replicas' nodes only, their owners known from before the change."""
        me = self.replica
        was_known = self._previous[1] if self._previous[0] == before else {}
        now_known = self._owners[1] if self._owners[0] is self.live and self.live == after else {}
        gone, new = before - after, after - before
        gained: list[str] = []
        lost: list[str] = []
        for node in nodes:
            was = was_known[node] if node in was_known else owner_of(node, before)
            if not new and was not in gone:
                now = was  # nobody joined and its owner stayed: it stays
            elif not gone and was is not None and not any((score(node, r), r) > (score(node, was), was) for r in new):
                now = was  # nobody left and no newcomer outscores its owner
            else:
                now = owner_of(node, after)
            now_known[node] = now
            if now == me and was != me:
                gained.append(node)
            elif was == me and now != me:
                lost.append(node)
        return gained, lost

    async def wait_for(self, replicas: set[str] | frozenset[str]) -> None:
        """Return once this replica's view of the live set is exactly `replicas`."""
        while self.live != replicas:
            changed = self._changed
            await changed.wait()

    async def settle(self) -> None:
        """Return once the live set has not changed for one heartbeat: replicas started together have
        seen one another's first beats (an absence of events has to be waited out; nothing else signals it)."""
        while True:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), self.heartbeat_s)
            except TimeoutError:
                return

    async def start(self) -> None:
        """Beat once, read the current members, then keep beating and watching."""
        self._kv = await self.bus.kv(REPLICAS_BUCKET)
        # answering before the first heartbeat: whoever sees the heartbeat finds the answer there
        self._answering = await presence.answer(self.bus.nc, presence_subject(self.replica))
        self.bus.on_reconnect(self._reconnected)
        await self._beat()
        self._seen[self.replica] = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._beat_loop(), name=f"heartbeat-{self.replica}"),
            asyncio.create_task(self._watch_loop(), name=f"members-{self.replica}"),
            asyncio.create_task(self._expire_loop(), name=f"expire-{self.replica}"),
        ]
        if self.probe_s > 0:
            self._tasks.append(asyncio.create_task(self._probe_loop(), name=f"probe-{self.replica}"))
        await self._synced.wait()
        self._recompute()

    async def stop(self, *, clean: bool = True) -> None:
        """Stop beating; a clean stop deletes the key so peers take the nodes over at once."""
        await cancel_and_wait(self._tasks)
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._answering is not None:  # a stopped replica is gone to its peers' probes too
            with contextlib.suppress(Exception):
                await self._answering.unsubscribe()
            self._answering = None
        if clean and self._kv is not None:
            with contextlib.suppress(Exception):
                await self._kv.delete(self.replica)

    async def _beat(self) -> None:
        self._seq += 1
        assert self._kv is not None
        await self._kv.put(
            self.replica,
            ReplicaHeartbeat(replica=self.replica, started_at=self._started, beat_at=time.time(), seq=self._seq),
        )

    async def _beat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self._beat()
            except Exception as exc:  # noqa: BLE001 - NATS may be reconnecting; peers wait lease_s
                log.warning("publisher heartbeat failed", replica=self.replica, error=str(exc))

    async def _watch_loop(self) -> None:
        assert self._kv is not None
        while True:
            try:
                async for key, value in self._kv.watch(">"):
                    if key == "":
                        self._synced.set()
                    elif value is None:
                        if key != self.replica:
                            self._seen.pop(key, None)
                            self._gone.pop(key, None)
                            self._recompute()
                    else:
                        self._observe(key, value)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - watch again after a NATS hiccup
                log.warning("replica watch failed; watching again", error=str(exc))
                await asyncio.sleep(self.heartbeat_s)

    def _observe(self, key: str, beat: ReplicaHeartbeat) -> None:
        age = time.time() - beat.beat_at
        if key != self.replica and age > self.lease_s:
            # A heartbeat left behind by a replica that died (seen on the initial read).
            if age > 10 * self.lease_s and self._kv is not None:
                self.bus.spawn(self._kv.delete(key))
            return
        if key in self._gone:
            return  # a probe found its connection gone: only a probe that finds it again brings it back
        fresh = key not in self._seen
        self._seen[key] = time.monotonic()
        if fresh:
            self._recompute()

    def _reconnected(self) -> None:
        # peers reconnect after this replica does, each at its own time: until a lease has passed, a probe
        # nobody answers may be a peer still on its way back, not a dead one
        self._probes_from = time.monotonic() + self.lease_s
        self._misses.clear()

    async def _probe_loop(self) -> None:
        """Every `probe_s`, ask each peer again, whatever is still out. Each answer is taken as it comes. A probe
        waits up to a lease: one read late on a busy loop still tells no-responders from a timeout. A probe
        the peer took and never answered (it was paused, then killed) delays nothing: the next one asks anew."""
        nc = self.bus.nc
        most = max(1, round(self.lease_s / self.probe_s))  # out at once per peer: a paused one's, for a lease
        try:
            while True:
                await asyncio.sleep(self.probe_s)
                if not nc.is_connected or time.monotonic() < self._probes_from:
                    continue
                for peer in [r for r in self._seen if r != self.replica] + list(self._gone):
                    out = self._asking.setdefault(peer, set())
                    if len(out) < most:
                        asked = asyncio.ensure_future(presence.probe(nc, presence_subject(peer), self.lease_s))
                        asked.add_done_callback(functools.partial(self._answered, peer))
                        out.add(asked)
        finally:
            for out in self._asking.values():
                for pending in out:
                    pending.cancel()
            self._asking.clear()

    def _answered(self, peer: str, probe: asyncio.Future[bool | None]) -> None:
        out = self._asking.get(peer)
        if out is not None:
            out.discard(probe)
            if not out:
                del self._asking[peer]
        # a probe waits at most a lease, as long as probes count for nothing after a reconnect: one that ends
        # after that was asked after the reconnect
        if probe.cancelled() or probe.exception() is not None or time.monotonic() < self._probes_from:
            return
        self._probed(peer, probe.result())

    def _probed(self, peer: str, present: bool | None) -> None:
        now = time.monotonic()
        if peer in self._gone:
            if present:  # connected again (a false alarm, or it reconnected): its heartbeats count again
                del self._gone[peer]
                self._seen[peer] = now
                log.info("publisher replica answers again", replica=self.replica, peer=peer)
                self._recompute()
            elif now - self._gone[peer] > self.lease_s:
                del self._gone[peer]  # its last heartbeat is older than a lease by now
        elif present:
            self._misses.pop(peer, None)
        elif present is False:
            self._misses[peer] = misses = self._misses.get(peer, 0) + 1
            if misses >= PROBE_MISSES:
                del self._misses[peer]
                self._seen.pop(peer, None)
                self._gone[peer] = now
                REPLICAS_LOST.labels("connection").inc()
                log.info("publisher replica's connection is gone; its nodes move", replica=self.replica, peer=peer)
                self._recompute()
        # None: a timeout, which says nothing either way

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.heartbeat_s, self.lease_s / 10))  # gone within 10% past the lease
            self._recompute()

    def _recompute(self) -> None:
        now = time.monotonic()
        self._seen[self.replica] = now  # this replica is live while it runs
        live = frozenset(r for r, seen in self._seen.items() if now - seen < self.lease_s)
        for gone in set(self._seen) - live:
            self._seen.pop(gone, None)
            REPLICAS_LOST.labels("lease").inc()
        if live != self.live:
            self._previous = self._owners if self._owners[0] is self.live else (self.live, {})
            before, self.live = self.live, live
            self._owners = (live, {})
            LIVE_REPLICAS.set(len(live))
            log.info("publisher replicas changed", replica=self.replica, live=",".join(sorted(live)))
            if self.on_change is not None:
                self.on_change(before, live)
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()


def presence_subject(replica: str) -> str:
    """Where `replica` answers its peers' probes while its NATS connection lasts."""
    return presence.subject_of(PUBLISHER_PRESENCE_SUBJECT, replica)
