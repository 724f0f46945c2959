"""The publisher run loop: NATS inventory and health in, one work queue keyed by node, slices out.

Owns the wiring and the node-level state machine: what the publisher believes about every node
(last inventory, device health, withdrawal), which nodes this replica owns (`ownership`), the work
queue that coalesces bursts per node, the periodic resync from KV and a fresh LIST, the rule for
deleting a node's slices (an explicit withdrawal, or the Node gone for the grace; never an empty or
unreadable KV read), the sharing config (a `--node-config` file, else every NodeConfig object, watched:
a change re-publishes the slices of the nodes whose GPU settings it changes; `nodeconfigs`), and the trace
of each sync (a child of the inventory or health event that caused it; coalesced causes are links).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

from services.publisher import apiversion, slices, split
from services.publisher.config import PublisherConfig
from services.publisher.nodeconfigs import NodeConfigWatch
from services.publisher.nodes import NodeWatcher
from services.publisher.nodestate import NodeState
from services.publisher.ownership import Membership
from services.publisher.taintevents import TaintEvents
from services.publisher.writer import InvalidSlice, SliceWriter, WriteStats
from shared import nodeconfig
from shared.bus import Bus, MsgContext
from shared.events import catalog
from shared.events.health import DeviceHealth
from shared.events.inventory import InventoryWithdrawn, NodeInventory
from shared.heap import settle
from shared.logs import get_logger
from shared.tasks import cancel_and_wait
from shared.telemetry import PERIODIC, get_tracer
from shared.workqueue import WorkQueue

log = get_logger(__name__)
tracer = get_tracer(__name__)
_RESYNC_KEY = otel_context.create_key("gpu_dra.publisher.resync")
RESYNC = otel_context.set_value(_RESYNC_KEY, True, otel_context.Context())  # a cause: the periodic resync

WRITES = Counter("gpu_dra_publisher_slice_writes", "ResourceSlice writes", ["verb"])
LATENCY = Histogram(
    "gpu_dra_publisher_inventory_to_slice_seconds",
    "From an inventory's observation to its slices being written",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
QUEUE_DEPTH = Gauge("gpu_dra_publisher_queue_depth", "Nodes waiting for a slice sync or being synced")
OWNED_NODES = Gauge("gpu_dra_publisher_owned_nodes", "Nodes with an inventory that this replica owns")
RETRY_DELAY_S = 2.0
# Nodes read or synced between two gc.freeze() of a bulk load (see shared.heap). What was frozen last is
# long-lived then; each full pass walks what came since, and one comes every few hundred nodes: at 1,024 a
# cold start's collector took 4.3 s of 16 s CPU at 10,000 nodes, at 64 2.1 s (an inventory decodes in 65 us
# with no full pass and 127 us with them, 10,000 kept).
FREEZE_EVERY = 64
KV_READS = 64  # inventories read from KV at once (at start, at a resync, on taking nodes over)
KV_CHUNK = 1024  # keys whose reads are started together
KV_FIRST_CHUNK = 64  # the first chunk of a start or a takeover, doubled each time up to KV_CHUNK: its nodes
# (a takeover's most recently changed) are written while the rest is read


class Publisher:
    """One publisher replica."""

    def __init__(
        self, cfg: PublisherConfig, bus: Bus, api_client: Any, profile: apiversion.ServerProfile | None = None
    ) -> None:
        self.cfg = cfg
        self.bus = bus
        self.api = api_client
        self.taint_events = TaintEvents(api_client)  # Events on the Node when a device taint changes
        self.profile = profile
        self.opts = slices.SliceOptions(
            mig_mode=cfg.mig_mode,
            taint_effect=cfg.taint_effect,
            compute_domains=cfg.compute_domains,
            passthrough=cfg.passthrough,
            disabled_features=frozenset(n for n, on in cfg.gates.items() if not on),
        )
        # how each node pool's GPUs are shared: a --node-config file (read once at start), else the NodeConfig
        # objects, watched (services.publisher.nodeconfigs); the two never mix
        self.node_config = nodeconfig.load(cfg.node_config) if cfg.node_config else nodeconfig.DEFAULT
        self.nodeconfigs: NodeConfigWatch | None = (
            None
            if cfg.node_config
            else NodeConfigWatch(
                api_client,
                on_config=self._config_changed,
                owns=lambda name: self.membership.owns(f"nodeconfig/{name}"),
                idle=self.idle,
            )
        )
        self._stopping = asyncio.Event()
        self._shares_withheld_logged = False
        self.state = NodeState()
        self.queue: WorkQueue[str] = WorkQueue()
        QUEUE_DEPTH.set_function(lambda: len(self.queue))  # read at scrape time: nodes waiting or syncing
        OWNED_NODES.set_function(lambda: sum(1 for node in self.state.inventory if self.membership.owns(node)))
        self.writer: SliceWriter | None = None
        self.nodes = NodeWatcher(api_client, self._node_changed)
        self.membership = Membership(
            bus,
            cfg.replica_id,
            heartbeat_s=cfg.heartbeat_seconds,
            lease_s=cfg.lease_seconds,
            probe_s=cfg.probe_seconds,
            on_change=self._members_changed,
        )
        self.latencies: list[float] = []
        self.syncs = 0
        self._notes: dict[str, tuple[str, ...]] = {}
        self._gone_since: dict[str, float] = {}  # node -> when (monotonic) it was first seen gone from Kubernetes
        self._grace_timers: dict[str, asyncio.TimerHandle] = {}
        # node -> the cause of a sync that had an inventory to write but no Node yet: the sync the Node's
        # arrival starts continues that trace (a node's first slices, in discovery's trace)
        self._awaiting_node: dict[str, otel_context.Context] = {}
        self._early_causes: dict[str, otel_context.Context] = {}  # node -> the last cause seen before ready
        self._bulk = 0  # node syncs done, for freezing the cache as it grows
        self._unlisted: set[str] = set()  # nodes taken over from another replica: their slices not read yet
        # the initial bulk (every node known at start): one line at its end, a debug line per node meanwhile
        self._bulk_left: set[str] = set()
        self._bulk_stats = WriteStats()
        self._bulk_written = 0
        self._bulk_began = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = False
        self.started = asyncio.Event()
        self._synced = asyncio.Event()

    @property
    def stats(self) -> WriteStats:
        return self.writer.stats if self.writer else WriteStats()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.profile is None:
            self.profile = await apiversion.discover(
                self.api, wanted=self.cfg.api_version, layout=self.cfg.counter_layout
            )
        log.info(
            "publishing ResourceSlices",
            api=self.profile.group_version,
            server=self.profile.git_version,
            counter_layout=self.profile.counter_layout,
            mig_mode=self.cfg.mig_mode,
            replica=self.cfg.replica_id,
        )
        self.writer = SliceWriter(self.api, self.profile)
        # Subscribe before reading KV: a change in between is seen twice, never missed.
        await self.bus.subscribe(catalog.INVENTORY, self._on_inventory)
        await self.bus.subscribe(catalog.INVENTORY_WITHDRAWN, self._on_withdrawn)
        await self.bus.subscribe(catalog.HEALTH, self._on_health)
        self.bus.on_reconnect(self._reconnected)
        # Membership first: which nodes are ours decides which inventories are read and kept.
        await self.membership.start()
        await self.membership.settle()  # replicas started together see one another before any node is read
        read_began = self.state.received
        if self.nodeconfigs is not None:
            self._tasks.append(asyncio.create_task(self.nodeconfigs.run(self._stopping), name="nodeconfig-watch"))
        self._tasks.append(asyncio.create_task(self.nodes.run(), name="node-watch"))
        # The inventory keys, the health (before any write: an unhealthy device is never offered first), our
        # slices and the Nodes are independent reads of two servers: made at once.
        inventory_keys = asyncio.ensure_future(self._inventory_keys())
        await asyncio.gather(
            inventory_keys,
            self._load_health(read_began),
            *(self.writer.list_driver(driver) for driver in slices.DRIVERS),
            self.nodes.synced.wait(),
        )
        keys = inventory_keys.result()
        if self.nodeconfigs is not None:
            await self.nodeconfigs.ready.wait()  # the first syncs already use the objects' config: no flapping
        if self.nodeconfigs is not None:
            self._tasks.append(asyncio.create_task(self.nodeconfigs.run_status(), name="nodeconfig-status"))
            self.nodeconfigs.mark()
        self._tasks += [
            asyncio.create_task(self._worker(), name=f"publisher-worker-{i}") for i in range(self.cfg.workers)
        ]
        self._tasks.append(asyncio.create_task(self._resync_loop(), name="publisher-resync"))
        self._ready = True
        early, self._early_causes = self._early_causes, {}
        for key in keys:  # every node's name (another replica's: the name only; withdrawals and removals apply)
            self.state.observed.setdefault(key, 0.0)
        mine = [key for key in keys if self.membership.owns(key)]
        self._bulk_left = self._known_nodes()
        self._bulk_began = time.monotonic()
        for node in self._bulk_left.difference(mine):  # no inventory of ours to read: slices or a name only
            self.queue.add(node, early.get(node))
        # Each chunk of inventories is written while the next is read: the reads wait on NATS, the writes on
        # the API server, and neither waits for the whole fleet to be read.
        await self._read_and_queue(mine, early, tolerant=False)
        self.started.set()

    async def stop(self, *, clean: bool = True) -> None:
        """Stop; a clean stop hands this replica's nodes to its peers at once."""
        self._ready = False
        self._stopping.set()
        for timer in self._grace_timers.values():
            timer.cancel()
        self._grace_timers.clear()
        await self.membership.stop(clean=clean)
        await cancel_and_wait(self._tasks)
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
        self._tasks = []

    async def idle(self) -> None:
        """Return once no node is waiting or being synced."""
        await self.queue.wait_idle()

    def next_sync(self) -> asyncio.Event:
        """An event set when the next node sync finishes (for tests and benchmarks: no polling)."""
        return self._synced

    def _known_nodes(self) -> set[str]:
        store_nodes = self.writer.store.nodes() if self.writer else set()
        return self.state.nodes() | store_nodes

    # ------------------------------------------------------------------ inputs
    def _enqueue(self, node: str, ctx: otel_context.Context | None = None) -> None:
        if self._ready and self.membership.owns(node):
            self.queue.add(node, ctx)
        elif not self._ready and ctx is not None:
            self._early_causes[node] = ctx  # an event consumed while starting: its sync at start continues it

    async def _on_inventory(self, inv: NodeInventory, _ctx: MsgContext) -> None:
        if self.state.set_inventory(inv, keep=self.membership.owns(inv.node)):
            self._enqueue(inv.node, otel_context.get_current())

    async def _on_withdrawn(self, msg: InventoryWithdrawn, _ctx: MsgContext) -> None:
        # Authenticated: only the node's own user may publish on its subject, and the bus refuses a
        # message whose `node` is not the subject's (the catalog's binds).
        log.info("inventory withdrawn; deleting the node's slices", node=msg.node, reason=msg.reason)
        self.state.withdraw(msg.node, msg.observed_at or time.time())
        self._enqueue(msg.node, otel_context.get_current())

    async def _on_health(self, h: DeviceHealth, _ctx: MsgContext) -> None:
        if self.state.set_health(h):
            self._enqueue(h.node, otel_context.get_current())

    def _reconnected(self) -> None:
        if self._ready:
            self.bus.spawn(self._catch_up())

    async def _catch_up(self) -> None:
        """After a NATS reconnect: the subscriptions above missed what was published while the
        connection was away (a NATS node lost), so re-read KV, as at start, and sync every node."""
        try:
            brought = await self._load_kv()
        except Exception as exc:  # noqa: BLE001 - the periodic resync repairs it
            log.warning("re-reading KV after a NATS reconnect failed; the next resync repairs it", error=str(exc))
            return
        log.info("KV re-read after a NATS reconnect", nodes=len(self.state.inventory))
        for node in self._known_nodes():
            self._enqueue(node, brought.get(node))

    def _node_changed(self, node: str) -> None:
        self._enqueue(node, self._awaiting_node.pop(node, None) if node in self.nodes.uids else None)

    def _config_changed(self, old: nodeconfig.NodeConfig, new: nodeconfig.NodeConfig) -> None:
        """The NodeConfig objects changed the config: re-publish the nodes whose GPU settings differ (other
        nodes are not even synced). Slices change for new allocations only; claims are never touched."""
        self.node_config = new
        affected = [
            node
            for node, inv in self.state.inventory.items()
            if nodeconfig.resolve(old, self.nodes.labels.get(node, {}), inv.gpus)
            != nodeconfig.resolve(new, self.nodes.labels.get(node, {}), inv.gpus)
        ]
        log.info("sharing config changed", rules=len(new.spec.rules), nodes=len(affected))
        for node in affected:
            self._enqueue(node)

    def _members_changed(self, before: frozenset[str], after: frozenset[str]) -> None:
        me = self.cfg.replica_id
        known = self._known_nodes()
        gained, lost = self.membership.moved(known, before, after)
        self.state.release(lost)
        for node in self._bulk_left.intersection(lost):  # still to be read at start: now another replica's
            self._bulk_synced(node)
        if self.writer is not None:
            self.writer.store.forget(lost)
        if gained:
            log.info("nodes taken over", replica=me, count=len(gained))
            self._unlisted.update(gained)  # written by another replica: re-read before the first sync
            self.bus.spawn(self._take_over(gained))

    async def _take_over(self, gained: list[str]) -> None:
        """Read the gained nodes' inventories from KV (the last values: no replay, no gap), then sync them. The
        most recently changed first, a chunk queued as soon as it is read: a change published while the node
        had no live owner is written before the thousands of unchanged nodes are re-read and found current."""
        by_recency = sorted(gained, key=lambda node: self.state.observed.get(node, 0.0), reverse=True)
        await self._read_and_queue(by_recency, {}, tolerant=True)
        if self.nodeconfigs is not None:
            self.nodeconfigs.mark()  # the NodeConfig objects this replica now owns get their status checked

    async def _read_and_queue(
        self, nodes: list[str], causes: dict[str, otel_context.Context], *, tolerant: bool
    ) -> None:
        """Read `nodes`' inventories from KV a chunk at a time (KV_FIRST_CHUNK, doubling to KV_CHUNK), in their
        order, and queue each chunk's nodes as soon as it is read (with the read's context, else `causes`').
        `tolerant`: a chunk that cannot be read is left to the next resync (logged), else the error is raised."""
        start, size = 0, KV_FIRST_CHUNK
        while start < len(nodes):
            chunk = nodes[start : start + size]
            start, size = start + size, min(KV_CHUNK, size * 2)
            try:
                brought = await self._load_kv(only=chunk)
            except Exception as exc:
                if not tolerant:
                    raise
                log.warning("reading inventories failed; the next resync repairs it", nodes=len(chunk), error=str(exc))
                brought = {}
            for node in chunk:
                self._enqueue(node, brought.get(node) or causes.get(node))

    async def _load_kv(self, only: list[str] | None = None) -> dict[str, otel_context.Context]:
        """Merge the KV's last values into the state (of `only` these nodes: inventories alone); what KV no
        longer holds (and no event renewed) goes. Every key's name is kept; the values read are those of
        the nodes this replica owns, KV_READS at a time.
        Returns, for each node whose inventory this read brought (a node's first inventory, or one whose
        event was missed), the context of its consumer span, a child of discovery's write of it."""
        read_began = self.state.received
        kv = await self.bus.kv(catalog.INVENTORY_BUCKET)
        keys = await kv.keys() if only is None else only
        mine = [key for key in keys if self.membership.owns(key)]
        gate = asyncio.Semaphore(KV_READS)
        reads = 0

        async def read(key: str) -> NodeInventory | None:
            nonlocal reads
            async with gate:
                inv = await kv.get(key)
            reads += 1
            if reads % FREEZE_EVERY == 0:
                gc.freeze()  # what was read lives on: out of the collector's passes (a resync's settle() collects)
            return inv

        brought: dict[str, otel_context.Context] = {}
        for start in range(0, len(mine), KV_CHUNK):
            chunk = mine[start : start + KV_CHUNK]
            for key, inv in zip(chunk, await asyncio.gather(*(read(key) for key in chunk)), strict=True):
                if inv is not None and self.state.set_inventory(inv, keep=self.membership.owns(key)):
                    with kv.consume(key):
                        brought[inv.node] = otel_context.get_current()
        for key in keys:  # another replica's: the name only (withdrawals and Node removals still apply)
            self.state.observed.setdefault(key, 0.0)
        if only is not None:
            return brought
        await self._load_health(read_began)
        return brought

    async def _inventory_keys(self) -> list[str]:
        return await (await self.bus.kv(catalog.INVENTORY_BUCKET)).keys()

    async def _load_health(self, read_began: int) -> None:
        """Merge the health KV into the state; forget what it no longer holds (and nothing renewed since)."""
        health = await (await self.bus.kv(catalog.HEALTH_BUCKET)).items()
        for h in health.values():
            self.state.set_health(h)
        self.state.drop_absent({(h.node, h.device) for h in health.values()}, read_began)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.resync_seconds)
            try:
                await self.resync()
            except Exception as exc:  # noqa: BLE001 - try again next period
                log.warning("resync failed", error=str(exc))

    async def resync(self) -> None:
        """Re-read KV and every slice, then sync every owned node (writing only what differs)."""
        assert self.writer is not None
        brought = await self._load_kv()
        for driver in slices.DRIVERS:
            await self.writer.list_driver(driver)
        for node in self._known_nodes():
            self._enqueue(node, brought.get(node, RESYNC))  # an inventory the events missed is traced
        settle()  # once per resync: the fleet's objects, re-read, are frozen again

    # ------------------------------------------------------------------ sync
    async def _worker(self) -> None:
        while True:
            node, causes = await self.queue.get()
            try:
                await self.sync_node(node, causes)
            except (InvalidSlice, split.SplitError) as exc:
                log.error("slices for node not published", node=node, error=str(exc))
            except Exception as exc:  # noqa: BLE001 - retried later; the queue keeps going
                log.warning("node sync failed; retrying", node=node, error=str(exc), retry_s=RETRY_DELAY_S)
                self.bus.spawn(self._retry_later(node))
            finally:
                self.queue.done(node)
                if node in self._bulk_left:
                    self._bulk_synced(node)
                self._bulk += 1
                if self._bulk % FREEZE_EVERY == 0:
                    # A cold start's slices, cached, live on: each automatic full pass over them would find
                    # nothing to free (80% of the CPU of a decode at 5,000 nodes); the next settle() collects.
                    gc.freeze()
                done, self._synced = self._synced, asyncio.Event()
                done.set()

    def _bulk_synced(self, node: str) -> None:
        """One node of the initial bulk synced (or failed: its retry logs as any later sync); the last one logs
        what the bulk wrote."""
        self._bulk_left.discard(node)
        if not self._bulk_left:
            done = self._bulk_stats
            log.info(
                "initial slices written",
                nodes_written=self._bulk_written,
                creates=done.creates,
                updates=done.updates,
                deletes=done.deletes,
                seconds=round(time.monotonic() - self._bulk_began, 2),
            )

    async def _retry_later(self, node: str) -> None:
        await asyncio.sleep(RETRY_DELAY_S)
        self._enqueue(node)

    async def sync_node(self, node: str, causes: list[otel_context.Context] | None = None) -> WriteStats:
        """Bring one node's pools on the server to what its inventory and health call for."""
        assert self.writer is not None and self.profile is not None
        causes = causes or []
        parent = causes[-1] if causes else None
        links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in causes[:-1]]
        # only the periodic resync asked for it: a no-op pass, mostly; sampled low (shared.telemetry)
        periodic = bool(causes) and all(otel_context.get_value(_RESYNC_KEY, c) for c in causes)
        total = WriteStats()
        with tracer.start_as_current_span(
            "publisher.sync-node", context=parent, links=links, attributes={PERIODIC: periodic}
        ) as span:
            span.set_attribute("k8s.node.name", node)
            if not self.membership.owns(node):
                span.set_attribute("publisher.skipped", "not-owner")
                return total
            if node in self._unlisted:
                await self.writer.refresh_node(node)  # another replica wrote them: our cache knows nothing
                self._unlisted.discard(node)
            inv = self.state.inventory.get(node)
            uid = self.nodes.uids.get(node)
            pools: dict[str, slices.DesiredPool] = {}
            keep = self._keep_as_is(node, inv, uid)
            if keep:
                span.set_attribute("publisher.skipped", keep)
                if keep == "node-gone-grace" and inv is not None and parent is not None and not periodic:
                    self._awaiting_node[node] = parent
                return total
            if inv is not None and uid is not None:
                settings = (
                    nodeconfig.resolve(self.node_config, self.nodes.labels.get(node, {}), inv.gpus)
                    if self.node_config.spec.rules
                    else None
                )
                pools = slices.desired_pools(inv, self.state.health.get(node, {}), self.opts, self.profile, settings)
                self._note(node, tuple(n for p in pools.values() for n in p.notes))
                self._note_withheld(node, pools)
            # the node's pools are independent objects: written in parallel (the client's connection pool bounds
            # what is in flight at the API server)
            writer = self.writer
            for stats in await asyncio.gather(
                *(writer.sync(driver, node, pools.get(driver), uid or "") for driver in slices.DRIVERS)
            ):
                total.creates += stats.creates
                total.updates += stats.updates
                total.deletes += stats.deletes
                total.conflicts += stats.conflicts
            for verb, count in (("create", total.creates), ("update", total.updates), ("delete", total.deletes)):
                if count:
                    WRITES.labels(verb).inc(count)
            if uid is not None and pools:
                await self.taint_events.report(node, uid, pools)
            span.set_attribute("publisher.writes", total.writes)
            span.set_attribute("publisher.devices", sum(p.device_count for p in pools.values()))
            self.syncs += 1
            if total.writes and inv is not None and inv.observed_at > 0:
                latency = max(0.0, time.time() - inv.observed_at)
                self.latencies.append(latency)
                LATENCY.observe(latency)
            if total.writes:
                # a line per node after the start; during the initial bulk, one line at its end (_bulk_synced)
                bulk = node in self._bulk_left
                (log.debug if bulk else log.info)(
                    "slices written", node=node, creates=total.creates, updates=total.updates, deletes=total.deletes
                )
                if bulk:
                    self._bulk_written += 1
                    self._bulk_stats.creates += total.creates
                    self._bulk_stats.updates += total.updates
                    self._bulk_stats.deletes += total.deletes
        return total

    def _keep_as_is(self, node: str, inv: NodeInventory | None, uid: str | None) -> str:
        """Why a node's slices must stay as they are ("" when the sync may write). Slices are deleted
        only on an explicit withdrawal or once the Node has been gone from Kubernetes for the grace;
        a node whose inventory is unknown (KV read empty or undecodable, a restart during a NATS
        outage) keeps whatever slices it has."""
        if uid is not None:
            self._gone_since.pop(node, None)
            timer = self._grace_timers.pop(node, None)
            if timer is not None:
                timer.cancel()
        if node in self.state.withdrawn:
            return ""
        if uid is None:
            now = time.monotonic()
            left = self.cfg.node_gone_grace - (now - self._gone_since.setdefault(node, now))
            if left <= 0:
                self._note(
                    node, (f"Node gone from Kubernetes for {self.cfg.node_gone_grace:g} s; its slices are deleted",)
                )
                return ""
            self._note(
                node,
                (
                    f"no Node object; the node's slices are kept for up to {self.cfg.node_gone_grace:g} s "
                    "in case it comes back",
                ),
            )
            if node not in self._grace_timers:
                self._grace_timers[node] = asyncio.get_running_loop().call_later(left, self._grace_over, node)
            return "node-gone-grace"
        if inv is None:
            self._note(
                node,
                (
                    "no inventory known for this node (KV empty or unreadable); its slices are kept "
                    "as they are until discovery publishes or withdraws",
                ),
            )
            return "inventory-unknown"
        return ""

    def _grace_over(self, node: str) -> None:
        self._grace_timers.pop(node, None)
        self._enqueue(node)

    def _note_withheld(self, node: str, pools: dict[str, slices.DesiredPool]) -> None:
        """Once per replica: the NodeConfig asks for shares the server's API version cannot express."""
        withheld = sum(p.shares_withheld for p in pools.values())
        if withheld and not self._shares_withheld_logged and self.profile is not None:
            self._shares_withheld_logged = True
            log.warning(
                "GPU shares not offered: the server's resource.k8s.io version has no consumable capacity "
                "(allowMultipleAllocations, requestPolicy; needs v1 on Kubernetes 1.34+); "
                "shared GPUs are published whole",
                api=self.profile.group_version,
                server=self.profile.git_version,
                node=node,
                gpus=withheld,
            )

    def _note(self, node: str, notes: tuple[str, ...]) -> None:
        if self._notes.get(node) != notes:
            self._notes[node] = notes
            for note in notes:
                log.warning(note, node=node)


async def run_service(cfg: PublisherConfig, bus: Bus, api_client: Any, stop: asyncio.Event) -> None:
    publisher = Publisher(cfg, bus, api_client)
    await publisher.start()
    try:
        await stop.wait()
    finally:
        await publisher.stop()
