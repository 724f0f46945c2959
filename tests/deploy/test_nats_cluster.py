"""Three nats-server processes as one JetStream cluster on loopback, each run on the shipped
cluster config with the generated users: the catalog's streams and KV buckets with 3 replicas,
discovery users publishing inventories, a publisher-user durable consumer reading them, and the
stream leader killed (SIGKILL) mid-run. No event is lost or duplicated, the consumer sees every
event, and the KV holds each node's last inventory.
(The services themselves on this cluster, as processes: test_services_on_nats_cluster.py.)"""

from __future__ import annotations

import asyncio
import functools

import nats.errors
import nats.js.errors
import pytest
from nats.js.api import KeyValueConfig, StorageType, StreamConfig

from shared.bus import Bus, BusError, MsgContext
from shared.events import catalog
from shared.events.inventory import NodeInventory
from shared.jetstream import retry_jetstream
from tests.deploy.conftest import (
    CLUSTER_NODES,
    CLUSTER_SIZE,
    ShippedConfigNats,
    cluster_urls,
    test_password,
    wait_for_meta_leader,
)

NODES = CLUSTER_NODES
EVENTS_PER_NODE = 60
REPLICAS = CLUSTER_SIZE
FAILOVER_BUDGET_S = 30.0


@pytest.fixture
def cluster(nats_cluster: list[ShippedConfigNats]) -> list[ShippedConfigNats]:
    return nats_cluster


async def _connect(servers: list[ShippedConfigNats], user: str) -> Bus:
    return await Bus.connect(cluster_urls(servers), name=user, user=user, password=test_password(user))


async def _provision_replicated(bus: Bus, replicas: int) -> None:
    """The catalog's streams and buckets as Bus.provision() makes them, with `replicas` copies.
    Retries while the cluster elects its JetStream meta leader (no event tells us when), and a create
    that a loaded cluster answers late (the same config again is a no-op if the first one was made)."""
    await wait_for_meta_leader(bus)
    for stream in catalog.STREAMS:
        config = StreamConfig(
            name=stream.name,
            subjects=list(stream.subjects),
            max_age=stream.max_age_s,
            max_bytes=stream.max_bytes,
            storage=StorageType.FILE,
            duplicate_window=120.0,
            num_replicas=replicas,
        )
        await retry_jetstream(functools.partial(bus.js.add_stream, config), f"create stream {stream.name}")
    for bucket in catalog.BUCKETS:
        kv_config = KeyValueConfig(
            bucket=bucket.name, history=bucket.history, ttl=bucket.ttl_s or None, replicas=replicas, direct=True
        )
        await retry_jetstream(functools.partial(bus.js.create_key_value, kv_config), f"create KV bucket {bucket.name}")


async def _publish_with_retry(bus: Bus, inventory: NodeInventory, msg_id: str) -> list[str]:
    """What a producer must do through a leader change: retry with the same Nats-Msg-Id (the
    stream drops the duplicate if the first try was stored). Returns the errors retried."""
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FAILOVER_BUDGET_S
    errors: list[str] = []
    while loop.time() < deadline:
        try:
            await kv.put(inventory.node, inventory)
            await bus.publish(catalog.INVENTORY, inventory, msg_id=msg_id, node=inventory.node)
            return errors
        except (nats.errors.Error, nats.js.errors.Error, BusError, TimeoutError) as exc:
            errors.append(type(exc).__name__)
            await asyncio.sleep(0.1)
    raise AssertionError(f"{msg_id} not stored within {FAILOVER_BUDGET_S}s; retried {errors}")


def _inventory(node: str, seq: int) -> NodeInventory:
    return NodeInventory(
        node=node, driver_version="550.163.1", cuda_driver_version="12.4.0", content_hash=f"{node}-{seq}"
    )


async def test_killing_the_stream_leader_loses_no_event(cluster: list[ShippedConfigNats]) -> None:
    admin = await _connect(cluster, "admin")
    await _provision_replicated(admin, REPLICAS)
    info = await admin.js.stream_info(catalog.EVENTS_STREAM.name)
    assert info.config.num_replicas == REPLICAS

    publisher = await _connect(cluster, "publisher")
    producers = {node: await _connect(cluster, f"discovery.{node}") for node in NODES}
    expected = {f"{node}-{seq}" for node in NODES for seq in range(EVENTS_PER_NODE)}
    received: set[str] = set()
    deliveries = 0
    all_received = asyncio.Event()

    async def on_inventory(message: NodeInventory, ctx: MsgContext) -> None:
        nonlocal deliveries
        deliveries += 1
        received.add(ctx.headers["Nats-Msg-Id"])
        assert message.content_hash == ctx.headers["Nats-Msg-Id"]
        if received >= expected:
            all_received.set()

    await publisher.subscribe(catalog.INVENTORY, on_inventory, durable="publisher")
    killed = asyncio.Event()
    retried: list[str] = []

    async def produce(node: str) -> None:
        for seq in range(EVENTS_PER_NODE):
            if seq == EVENTS_PER_NODE // 2:
                await killed.wait()
            retried.extend(await _publish_with_retry(producers[node], _inventory(node, seq), f"{node}-{seq}"))

    async def kill_leader_mid_run() -> str:
        while len(received) < len(expected) // 3:  # let the consumer get going first
            await asyncio.sleep(0.02)
        cluster_info = (await admin.js.stream_info(catalog.EVENTS_STREAM.name)).cluster
        assert cluster_info is not None and cluster_info.leader is not None
        leader = cluster_info.leader
        victim = next(s for s in cluster if s.env["NATS_SERVER_NAME"] == leader)
        await victim.stop(kill=True)
        killed.set()
        return leader

    try:
        _, _, leader = await asyncio.gather(*(produce(n) for n in NODES), kill_leader_mid_run())
        await asyncio.wait_for(all_received.wait(), 30)
        assert received == expected

        survivors = [s for s in cluster if s.env["NATS_SERVER_NAME"] != leader]
        assert len(survivors) == REPLICAS - 1
        info = await admin.js.stream_info(catalog.EVENTS_STREAM.name)
        assert info.cluster is not None and info.cluster.leader != leader
        assert info.state.messages == len(expected), "lost or duplicated events in the stream"
        kv = await admin.kv(catalog.INVENTORY_BUCKET)
        for node in NODES:
            last = await kv.get(node)
            assert last is not None and last.content_hash == f"{node}-{EVENTS_PER_NODE - 1}"
        kinds = {kind: retried.count(kind) for kind in sorted(set(retried))}
        print(
            f"\nkilled leader {leader}; producer retries {kinds}; consumer deliveries {deliveries} "
            f"for {len(expected)} events"
        )
    finally:
        for bus in (*producers.values(), publisher, admin):
            await bus.close()


async def test_bus_provision_keeps_the_replicas_of_existing_streams(cluster: list[ShippedConfigNats]) -> None:
    admin = await _connect(cluster, "admin")
    try:
        await _provision_replicated(admin, REPLICAS)
        await admin.provision()  # what every service does at start (replicas defaults to 1)
        info = await admin.js.stream_info(catalog.EVENTS_STREAM.name)
        assert admin.replicas == 1
        assert info.config.num_replicas == REPLICAS
    finally:
        await admin.close()


async def test_bus_provision_creates_streams_and_buckets_with_the_configured_replicas(
    cluster: list[ShippedConfigNats],
) -> None:
    admin = await Bus.connect(
        cluster_urls(cluster), name="admin", user="admin", password=test_password("admin"), replicas=REPLICAS
    )
    try:
        await wait_for_meta_leader(admin)
        await admin.provision()
        for stream in catalog.STREAMS:
            assert (await admin.js.stream_info(stream.name)).config.num_replicas == REPLICAS, stream.name
        for bucket in catalog.BUCKETS:
            info = await admin.js.stream_info(f"KV_{bucket.name}")
            assert info.config.num_replicas == REPLICAS, bucket.name
    finally:
        await admin.close()


async def test_bus_publish_retries_a_leader_change_without_doubling_events(cluster: list[ShippedConfigNats]) -> None:
    """Bus.publish itself (no retry loop in the caller) rides through the stream leader's SIGKILL;
    Nats-Msg-Id de-duplication keeps every event exactly once."""
    admin = await _connect(cluster, "admin")
    await _provision_replicated(admin, REPLICAS)
    producer = await _connect(cluster, "discovery.gpu-a")
    count = 40
    try:
        cluster_info = (await admin.js.stream_info(catalog.EVENTS_STREAM.name)).cluster
        assert cluster_info is not None and cluster_info.leader is not None
        leader = cluster_info.leader
        victim = next(s for s in cluster if s.env["NATS_SERVER_NAME"] == leader)
        for seq in range(count):
            if seq == count // 2:
                await victim.stop(kill=True)
            inventory = _inventory("gpu-a", seq)
            await (await producer.kv(catalog.INVENTORY_BUCKET)).put("gpu-a", inventory)
            await producer.publish(catalog.INVENTORY, inventory, msg_id=f"gpu-a-{seq}", node="gpu-a")
        # a repeated publish of an already stored id is dropped, not doubled
        await producer.publish(catalog.INVENTORY, _inventory("gpu-a", 0), msg_id="gpu-a-0", node="gpu-a")
        info = await admin.js.stream_info(catalog.EVENTS_STREAM.name)
        assert info.cluster is not None and info.cluster.leader != leader
        assert info.state.messages == count
        last = await (await admin.kv(catalog.INVENTORY_BUCKET)).get("gpu-a")
        assert last is not None and last.content_hash == f"gpu-a-{count - 1}"
    finally:
        await producer.close()
        await admin.close()
