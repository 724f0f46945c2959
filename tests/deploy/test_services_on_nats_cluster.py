"""The services on a 3-node JetStream cluster, one NATS node SIGKILLed mid-run.

Three nats-server processes on the shipped cluster config and generated users (the `nats_cluster`
fixture), the embedded API server, and every service as its own OS process connected to all three
URLs as its own NATS user: per node (gpu-a, gpu-b) discovery (`discovery.<node>`) and preparer
(`preparer.<node>`), one publisher (`publisher`); streams and buckets with 3 replicas.
Once both nodes' ResourceSlices exist, the DRA_EVENTS stream leader is killed (kill -9), and at once,
while the cluster elects new leaders, an XID is injected on gpu-a (over the bus) and gpu-b's discovery
is restarted with a third GPU. The ResourceSlices converge (gpu-a/gpu-0 tainted, gpu-b with three
devices), the preparers' views follow, and every inventory and health event published during the
outage is in DRA_EVENTS exactly once. The killed server then restarts and catches up.
(A preparer's KV watch whose consumer lived on the killed node resumes only once nats-py has missed two
of its 5 s idle heartbeats, so the preparers may follow the slices by 10-20 s.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import nats.errors
import pytest
from nats.aio.msg import Msg

from embedded.cluster.processes import ProcessFailed, Supervisor, gpu_dra
from embedded.harness.publisher import ensure_node
from services.preparer.protos import dra_health_v1alpha1_pb2 as health_pb2
from services.preparer.protos import dra_health_v1alpha1_pb2_grpc as health_grpc
from services.publisher.ownership import REPLICAS_BUCKET
from shared.bus import PUBLISH_RETRY_S, Bus, BusError
from shared.events import catalog
from shared.events.devices import InjectXidRequest
from shared.jetstream import ordered_consumer, retry_jetstream
from shared.kube import rest as kube
from shared.kube.client import kube_api_client
from shared.ports import free_port
from tests.deploy.conftest import (
    CLUSTER_NODES,
    CLUSTER_SIZE,
    ShippedConfigNats,
    cluster_urls,
    server_name,
    test_password,
    wait_for_meta_leader,
)

pytestmark = pytest.mark.timeout(180)

GPU_DRIVER = "gpu.nvidia.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
XID_NODE, XID_DEVICE, XID = CLUSTER_NODES[0], "gpu-0", 79
GROWN_NODE = CLUSTER_NODES[1]
START_TIMEOUT = 60.0
CONVERGE_TIMEOUT = 45.0  # publishes retry for 30 s (shared.bus.PUBLISH_RETRY_S); a leader change takes ~5-7 s


@dataclass
class World:
    """What the test watches, each view woken by one shared change notification."""

    log_dir: Path
    supervisors: list[Supervisor] = field(default_factory=list)
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> ResourceSlice
    preparer_views: dict[str, dict[str, int]] = field(default_factory=dict)  # node -> device -> health
    observed: list[tuple[float, str, str]] = field(default_factory=list)  # (monotonic, subject, Nats-Msg-Id)
    watchers: list[asyncio.Task[None]] = field(default_factory=list)  # what fills the views above
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def watch(self, coro: Awaitable[None], name: str) -> None:
        self.watchers.append(asyncio.ensure_future(coro))
        self.watchers[-1].set_name(name)

    def notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def changed(self) -> None:
        await self._changed.wait()

    def devices(self, node: str) -> dict[str, dict[str, Any]]:
        """The node's gpu.nvidia.com devices across its slices, by name."""
        return {
            d["name"]: d
            for s in self.slices.values()
            if s["spec"].get("nodeName") == node
            for d in s["spec"].get("devices") or []
        }

    def summary(self) -> str:
        slices = {
            n: {d: [t.get("key") for t in dev.get("taints") or []] for d, dev in self.devices(n).items()}
            for n in CLUSTER_NODES
        }
        return f"slices (device -> taint keys) {slices}; preparer views {self.preparer_views}"

    async def until(self, what: str, condition: Callable[[], bool], timeout: float) -> None:
        """Until `condition()` holds, re-checked on every change; fails naming `what` on a timeout or
        when any service process exits meanwhile."""

        async def satisfied() -> None:
            while not condition():
                await self.changed()

        waiter = asyncio.ensure_future(satisfied())
        failed = {sup.failed for sup in self.supervisors}
        try:
            watched: set[asyncio.Future[Any]] = {waiter, *failed, *self.watchers}
            done, _ = await asyncio.wait_for(asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED), timeout)
        except TimeoutError:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what}; {self.summary()}; service logs in {self.log_dir}"
            ) from None
        finally:
            waiter.cancel()
        if waiter in done:
            return
        for task in self.watchers:
            if task.done():
                raise AssertionError(f"{task.get_name()} ended while waiting for {what}") from task.exception()
        child = next(f for f in failed if f.done()).result()
        raise ProcessFailed(
            f"{child.name} exited while waiting for {what}; last lines of {child.log_path}:\n{child.tail()}"
        )


async def _watch_slices(api: Any, world: World) -> None:
    """List, then watch, the gpu.nvidia.com ResourceSlices into `world.slices` (re-list when the watch ends)."""
    query = [("fieldSelector", f"spec.driver={GPU_DRIVER}")]
    while True:
        listed = await kube.get_json(api, SLICES, query=query)
        world.slices = {s["metadata"]["name"]: s for s in listed["items"]}
        world.notify()
        rv = listed["metadata"]["resourceVersion"]
        with contextlib.suppress(kube.Gone):
            async for line in kube.watch_lines(api, SLICES, resource_version=rv, query=query, timeout_s=120):
                event = json.loads(line)
                obj = event["object"]
                if event["type"] == "DELETED":
                    world.slices.pop(obj["metadata"]["name"], None)
                elif event["type"] in ("ADDED", "MODIFIED"):
                    world.slices[obj["metadata"]["name"]] = obj
                world.notify()


async def _follow_preparer(node: str, socket: Path, world: World) -> None:
    """The preparer's DRAResourceHealth stream (its devices from discovery's KV, their health) into the world."""
    while True:
        try:
            async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
                stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                    health_pb2.NodeWatchResourcesRequest()
                )
                async for update in stream:
                    world.preparer_views[node] = {d.device.device_name: d.health for d in update.devices}
                    world.notify()
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.2)  # the socket is not there yet (no event tells us when it is)


async def _stored_ids(bus: Bus, stream: str, subject: str, wanted: set[str]) -> Counter[str]:
    """Nats-Msg-Id -> how often it is stored in `stream` under `subject`, read with an ordered consumer (the bus's
    replay, shared.jetstream.ordered_consumer) from the first message on until every `wanted` id has arrived and
    the stream's last sequence is read.

    A producer still retrying through the leader change (a reply can come before its event is stored, and
    one try may wait out nats-py's 5 s timeout) is waited for, not counted as a loss; so is this reader's own
    JetStream call that times out while the stream elects its leader."""
    arrived: asyncio.Queue[Msg] = asyncio.Queue()

    async def deliver(msg: Msg, _replayed: bool) -> None:
        await arrived.put(msg)

    sub, _ = await ordered_consumer(bus.nc, bus.js, stream, subject, deliver)
    ids: Counter[str] = Counter()
    try:
        while True:
            msg = await arrived.get()
            ids[(msg.headers or {}).get("Nats-Msg-Id", "")] += 1
            if msg.metadata.num_pending == 0 and wanted <= ids.keys():
                info = await retry_jetstream(lambda: bus.js.stream_info(stream), f"stream info of {stream}")
                if msg.metadata.sequence.stream >= info.state.last_seq:
                    return ids
    finally:
        await sub.unsubscribe()


async def _stream_listing(bus: Bus, stream: str) -> str:
    """Every message of `stream` by direct sequence lookup (for a failure message)."""
    state = (await bus.js.stream_info(stream)).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1):
        try:
            msg = await bus.js.get_msg(stream, seq)
            out.append(f"{seq}:{msg.subject}:{(msg.headers or {}).get('Nats-Msg-Id')}")
        except Exception as exc:  # noqa: BLE001 - a diagnostic
            out.append(f"{seq}:{type(exc).__name__}")
    return f"{state.messages} messages, seq {state.first_seq}-{state.last_seq}: {out}"


async def _connz(server: ShippedConfigNats) -> list[str]:
    """The names of the clients connected to `server` (its monitoring endpoint)."""
    port = server.env["NATS_MONITOR_PORT"]
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/connz?limit=1024") as resp:
        doc = await resp.json()
    return sorted(c.get("name", "") for c in doc.get("connections") or [])


async def _request_until_served(bus: Bus, entry: catalog.Entry, request: Any, node: str, deadline: float) -> Any:
    """A device request to `node`'s discovery, repeated while nobody answers (its NATS server just went and it
    is reconnecting and re-subscribing). Repeating is safe: an XID already recorded publishes nothing new."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return await bus.request(entry, request, timeout=20.0, node=node)
        except BusError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)


class Services:
    """The API server and every service as its own OS process (embedded.cluster.processes.Supervisor)."""

    def __init__(self, root: Path, urls: str) -> None:
        self.root = root
        self.urls = urls
        self.kubeconfig = root / "kubeconfig"
        # unix socket paths are limited to 107 bytes: the kubelet dirs live under a short /tmp dir
        self.socket_root = Path(tempfile.mkdtemp(prefix="gdra-", dir="/tmp"))
        self.main: Supervisor | None = None
        self.discovery: dict[str, Supervisor] = {}  # one each, so a discovery can be restarted alone
        self.world = World(root / "logs")

    def _nats_env(self, user: str) -> dict[str, str]:
        return {
            "GPU_DRA_NATS_URL": self.urls,
            "GPU_DRA_NATS_USER": user,
            "GPU_DRA_NATS_PASSWORD": test_password(user),
            "GPU_DRA_NATS_REPLICAS": str(CLUSTER_SIZE),
        }

    def dra_socket(self, node: str) -> Path:
        return self.socket_root / node / "plugins" / GPU_DRIVER / "dra.sock"

    def node_root(self, node: str) -> Path:
        return self.root / "nodes" / node

    async def start_apiserver(self) -> None:
        self.main = Supervisor(self.world.log_dir, restart=False)
        self.world.supervisors.append(self.main)
        await self.main.start(
            "apiserver",
            gpu_dra(
                "apiserver",
                "--port",
                str(free_port()),
                "--kubeconfig",
                str(self.kubeconfig),
                "--data-dir",
                str(self.root / "apiserver"),
                "--token",
                secrets.token_hex(16),
            ),
        )

    async def start_discovery(self, node: str, simulate: str, generation: int = 0) -> None:
        sup = Supervisor(self.world.log_dir, restart=False)
        self.discovery[node] = sup
        self.world.supervisors.append(sup)
        await sup.start(
            f"{node}-discovery-{generation}",
            gpu_dra("discovery", "--node", node, "--simulate", simulate, "--dev-root", str(self.node_root(node))),
            env=self._nats_env(f"discovery.{node}"),
        )

    async def stop_discovery(self, node: str) -> None:
        sup = self.discovery.pop(node)
        self.world.supervisors.remove(sup)
        await sup.stop()

    async def start_preparer(self, node: str) -> None:
        assert self.main is not None
        kubelet = self.socket_root / node
        await self.main.start(
            f"{node}-preparer",
            gpu_dra(
                "preparer",
                "--node",
                node,
                "--kubeconfig",
                str(self.kubeconfig),
                "--registry-dir",
                str(kubelet / "plugins_registry"),
                "--plugins-dir",
                str(kubelet / "plugins"),
                "--cdi-dir",
                str(self.node_root(node) / "var/run/cdi"),
                "--dev-root",
                str(self.node_root(node)),
            ),
            env=self._nats_env(f"preparer.{node}"),
        )

    async def start_publisher(self) -> None:
        assert self.main is not None
        # No periodic resync inside the test: the slices must converge from events, not from a timer.
        await self.main.start(
            "publisher",
            gpu_dra("publisher", "--kubeconfig", str(self.kubeconfig), "--resync-seconds", "3600"),
            env=self._nats_env("publisher"),
        )

    async def stop(self) -> None:
        for task in self.world.watchers:
            task.cancel()
        await asyncio.gather(*self.world.watchers, return_exceptions=True)
        for sup in [*self.discovery.values(), *([self.main] if self.main else [])]:
            await sup.stop()
        shutil.rmtree(self.socket_root, ignore_errors=True)


@contextlib.asynccontextmanager
async def services_on(servers: list[ShippedConfigNats], root: Path) -> AsyncIterator[Services]:
    services = Services(root, cluster_urls(servers))
    try:
        yield services
    finally:
        await services.stop()


async def test_services_converge_and_lose_no_event_when_a_nats_node_is_killed(
    nats_cluster: list[ShippedConfigNats], tmp_path: Path
) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    admin = await Bus.connect(
        cluster_urls(nats_cluster), name="test-admin", user="admin", password=test_password("admin")
    )
    api: Any = None
    observer: Bus | None = None
    try:
        await wait_for_meta_leader(admin)  # a fresh cluster elects one first (services would wait up to 30 s)
        async with services_on(nats_cluster, tmp_path) as svc:
            world = svc.world
            await svc.start_apiserver()
            assert svc.main is not None
            await svc.main.wait_until(
                "the API server's kubeconfig", lambda: _exists(svc.kubeconfig), timeout=START_TIMEOUT
            )
            await asyncio.gather(*(svc.start_discovery(node, "h100x2") for node in CLUSTER_NODES))
            api = await kube_api_client(str(svc.kubeconfig))
            await asyncio.wait_for(
                _retry_api(lambda: asyncio.gather(*(ensure_node(api, n) for n in CLUSTER_NODES))), START_TIMEOUT
            )
            world.watch(_watch_slices(api, world), "the ResourceSlice watch")
            await svc.start_publisher()
            for node in CLUSTER_NODES:
                await svc.start_preparer(node)
                world.watch(_follow_preparer(node, svc.dra_socket(node), world), f"{node}'s preparer health stream")

            await world.until(
                "both nodes' ResourceSlices with 2 GPUs each",
                lambda: all(len(world.devices(n)) == 2 for n in CLUSTER_NODES),
                START_TIMEOUT,
            )
            await world.until(
                "both preparers serving their 2 GPUs",
                lambda: all(len(world.preparer_views.get(n, {})) == 2 for n in CLUSTER_NODES),
                START_TIMEOUT,
            )
            buckets = [*catalog.BUCKETS, REPLICAS_BUCKET]  # the last: the publisher's own
            for stream in [s.name for s in catalog.STREAMS] + [f"KV_{b.name}" for b in buckets]:
                info = await admin.js.stream_info(stream)
                assert info.config.num_replicas == CLUSTER_SIZE, f"{stream} has {info.config.num_replicas} replicas"
            started_s = loop.time() - t0

            # --- the outage: SIGKILL the DRA_EVENTS stream leader, change the inventory at once
            cluster_info = (await admin.js.stream_info(catalog.EVENTS_STREAM.name)).cluster
            assert cluster_info is not None and cluster_info.leader is not None
            leader = cluster_info.leader
            victim = next(s for s in nats_cluster if server_name(s) == leader)
            survivors = [s for s in nats_cluster if s is not victim]
            on_victim = await _connz(victim)
            observer = await Bus.connect(
                cluster_urls(survivors), name="test-observer", user="admin", password=test_password("admin")
            )

            async def observe(msg: Msg) -> None:
                world.observed.append((loop.time(), msg.subject, (msg.headers or {}).get("Nats-Msg-Id", "")))
                world.notify()

            await observer.nc.subscribe("dra.v1.>", cb=observe)
            await observer.nc.flush()

            killed_at = loop.time()
            await victim.stop(kill=True)
            await svc.stop_discovery(GROWN_NODE)
            await svc.start_discovery(GROWN_NODE, "h100x3", generation=1)
            reply = await asyncio.wait_for(
                _request_until_served(
                    observer,
                    catalog.DEVICE_INJECT_XID,
                    InjectXidRequest(gpu_uuid=XID_DEVICE, xid=XID),
                    XID_NODE,
                    deadline=loop.time() + CONVERGE_TIMEOUT,
                ),
                CONVERGE_TIMEOUT + 25,
            )
            assert reply.ok, f"XID injection on {XID_NODE}/{XID_DEVICE} refused: {reply.error}"

            def xid_tainted() -> bool:
                taints = world.devices(XID_NODE).get(XID_DEVICE, {}).get("taints") or []
                return any(t.get("key") == f"{GPU_DRIVER}/xid" and t.get("value") == str(XID) for t in taints)

            await world.until(
                f"the XID {XID} taint on {XID_NODE}/{XID_DEVICE} and 3 GPUs in {GROWN_NODE}'s slices",
                lambda: xid_tainted() and len(world.devices(GROWN_NODE)) == 3,
                CONVERGE_TIMEOUT,
            )
            converged_s = loop.time() - killed_at
            await world.until(
                f"{GROWN_NODE}'s preparer serving its 3 GPUs and {XID_NODE}'s reporting {XID_DEVICE} unhealthy",
                lambda: (
                    len(world.preparer_views.get(GROWN_NODE, {})) == 3
                    and world.preparer_views.get(XID_NODE, {}).get(XID_DEVICE) == health_pb2.UNHEALTHY
                ),
                CONVERGE_TIMEOUT,
            )
            preparers_s = loop.time() - killed_at
            assert world.devices(XID_NODE).keys() == {"gpu-0", "gpu-1"}
            assert not world.devices(XID_NODE)["gpu-1"].get("taints")

            # --- every inventory and health event of the outage is in DRA_EVENTS exactly once
            kv_health = await (await observer.kv(catalog.HEALTH_BUCKET)).get(f"{XID_NODE}.{XID_DEVICE}")
            kv_inventory = await (await observer.kv(catalog.INVENTORY_BUCKET)).get(GROWN_NODE)
            assert kv_health is not None and kv_health.xid == XID
            assert kv_inventory is not None and len(kv_inventory.gpus) == 3

            def outage_ids() -> set[str]:
                return {
                    msg_id
                    for at, subject, msg_id in world.observed
                    if at >= killed_at and subject.startswith(("dra.v1.inventory.", "dra.v1.health."))
                }

            expected = {
                kv_health.event_id,
                f"inventory.{GROWN_NODE}.{kv_inventory.content_hash}.{kv_inventory.observed_at}",
            }
            # A service writes its KV value before it publishes the event, whose publish may still be retrying
            # through the stream's leader change: the value can be seen first.
            await world.until(
                f"the outage's events {sorted(expected)} seen on the bus",
                lambda: expected <= outage_ids(),
                PUBLISH_RETRY_S + 15,
            )
            outage = outage_ids()
            try:
                stored = await asyncio.wait_for(
                    _stored_ids(observer, catalog.EVENTS_STREAM.name, "dra.v1.>", outage), PUBLISH_RETRY_S + 15
                )
            except (TimeoutError, nats.errors.TimeoutError):
                raise AssertionError(
                    f"not every event published during the outage ({sorted(outage)}) reached DRA_EVENTS within "
                    f"{PUBLISH_RETRY_S + 15:.0f}s; the stream holds "
                    f"{await _stream_listing(observer, catalog.EVENTS_STREAM.name)}; seen on the bus "
                    f"{world.observed}"
                ) from None
            doubled = sorted(i for i, n in stored.items() if n > 1)
            assert not doubled, f"events stored more than once in DRA_EVENTS: {doubled}"
            info = await observer.js.stream_info(catalog.EVENTS_STREAM.name)
            assert info.cluster is not None and info.cluster.leader != leader

            # --- the killed server comes back and catches up
            checked_s = loop.time() - killed_at
            restarted_at = loop.time()
            await victim.start(timeout=30)

            async def caught_up() -> None:
                while True:
                    with contextlib.suppress(Exception):
                        cluster = (await observer.js.stream_info(catalog.EVENTS_STREAM.name)).cluster
                        peers = {p.name: p for p in (cluster.replicas if cluster else None) or []}
                        if leader in peers and peers[leader].current and not peers[leader].offline:
                            return
                    await asyncio.sleep(0.2)  # no event says when a peer is current again

            try:
                await asyncio.wait_for(caught_up(), 30)
            except TimeoutError:
                raise AssertionError(f"{leader} did not rejoin DRA_EVENTS as a current replica within 30s") from None
            print(
                f"\nstarted in {started_s:.1f}s; killed {leader} (the DRA_EVENTS leader; clients on it: "
                f"{', '.join(on_victim) or 'none'}); slices converged {converged_s:.1f}s after the kill, preparers "
                f"{preparers_s:.1f}s, stream checked {checked_s:.1f}s; "
                f"{len(outage)} events during the outage, each stored once; {leader} current again "
                f"{loop.time() - restarted_at:.1f}s after its restart; total {loop.time() - t0:.1f}s"
            )
    finally:
        if api is not None:
            await api.close()
        for bus in (observer, admin):
            if bus is not None:
                await bus.close()


async def _exists(path: Path) -> bool:
    return path.exists()


async def _retry_api(call: Callable[[], Awaitable[Any]]) -> Any:
    """`call()` retried while the API server is not yet answering (it writes the kubeconfig first)."""
    delay = 0.05
    while True:
        try:
            return await call()
        except (OSError, aiohttp.ClientError, kube.ApiError):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
