"""Telemetry identity, against a real nats-server on the shipped configuration and generated users: a node's
discovery may publish its own `dra.v1.telemetry.<node>` only. Another node's discovery (or any other service of
the node) publishing there is refused by the server; a body naming another node on its own subject is refused by
the dashboard's bus (identity mismatch, dead letter). The victim, the dashboard's rings for the node, holds only
what the node itself published, and the node's own messages keep arriving."""

from __future__ import annotations

import asyncio
import time

import msgspec

from services.dashboard.state import FleetState
from shared.events import catalog
from shared.events.telemetry import DeviceSample, NodeTelemetry
from shared.natsserver import EmbeddedNats
from tests.deploy.conftest import test_password
from tests.polling import eventually
from tests.security.conftest import bus_as, connect_watched

WAIT_S = 10.0


def sample(node: str, sm: int, at: float) -> NodeTelemetry:
    return NodeTelemetry(
        node=node,
        interval_s=10.0,
        observed_at=at,
        devices=[DeviceSample(device="gpu-0", uuid=f"GPU-{node}", sm_percent=sm, memory_total_bytes=80 << 30)],
    )


async def test_a_node_publishes_only_its_own_telemetry(shipped_nats: EmbeddedNats) -> None:
    victim_subject = catalog.TELEMETRY.format(node="gpu-a")
    now = time.time()
    async with bus_as(shipped_nats, "reader.dashboard") as dashboard_bus:
        state = FleetState(None)
        await state.subscribe_bus(dashboard_bus)
        await dashboard_bus.nc.flush()
        async with bus_as(shipped_nats, "discovery.gpu-a") as victim:
            await victim.publish(catalog.TELEMETRY, sample("gpu-a", 7, now), node="gpu-a")

            def seen() -> int | None:
                rings = state.telemetry.nodes.get("gpu-a")
                return len(rings.devices["gpu-0"].t) if rings is not None else None

            await eventually(seen, "gpu-a's own sample at the dashboard", timeout=WAIT_S)
            before = state.telemetry.node_view("gpu-a")

            # another node's discovery, and the victim node's preparer, on gpu-a's subject: refused by the server
            for attacker in ("discovery.gpu-b", "preparer.gpu-a"):
                conn = await connect_watched(shipped_nats.url, user=attacker, password=test_password(attacker))
                try:
                    forged = msgspec.json.encode(sample("gpu-a", 99, now + 5))
                    await conn.nc.publish(victim_subject, forged)
                    await conn.nc.flush()
                    await conn.refused("publish", victim_subject)
                finally:
                    await conn.nc.close()

            # gpu-b on its own subject, with a body naming gpu-a: allowed by the server, refused by the dashboard
            async with bus_as(shipped_nats, "discovery.gpu-b") as attacker_bus:
                mismatch = msgspec.json.encode(sample("gpu-a", 98, now + 5))
                await attacker_bus.nc.publish(catalog.TELEMETRY.format(node="gpu-b"), mismatch)
                await attacker_bus.publish(catalog.TELEMETRY, sample("gpu-b", 5, now + 5), node="gpu-b")
                await eventually(lambda: "gpu-b" in state.telemetry.nodes, "gpu-b's own sample", timeout=WAIT_S)

            # the victim's own next sample still arrives: the attacks changed nothing in between
            await victim.publish(catalog.TELEMETRY, sample("gpu-a", 8, now + 10), node="gpu-a")
            await eventually(lambda: seen() == 2, "gpu-a's second sample", timeout=WAIT_S)
        after = state.telemetry.node_view("gpu-a")
        assert before is not None and after is not None
        assert before["devices"]["gpu-0"]["ring"]["smPercent"] == [7]
        assert after["devices"]["gpu-0"]["ring"]["smPercent"] == [7, 8], "only gpu-a's own samples"
        assert after["observedAt"] == now + 10
        assert state.telemetry.node_view("gpu-b") is not None


async def test_the_dashboard_reads_telemetry_and_a_node_reads_only_its_own_claims(shipped_nats: EmbeddedNats) -> None:
    """The dashboard may subscribe to every node's telemetry; a node's discovery to its own node's claim events
    (the simulated load) and no other node's."""
    dashboard = await connect_watched(
        shipped_nats.url,
        user="reader.dashboard",
        password=test_password("reader.dashboard"),
        inbox_prefix="_INBOX_reader_dashboard",
    )
    node = await connect_watched(
        shipped_nats.url,
        user="discovery.gpu-a",
        password=test_password("discovery.gpu-a"),
        inbox_prefix="_INBOX_discovery_gpu-a",
    )
    try:
        await dashboard.nc.subscribe(catalog.TELEMETRY.wildcard())
        await node.nc.subscribe(catalog.CLAIM.wildcard(node="gpu-a"))
        await asyncio.gather(dashboard.nc.flush(), node.nc.flush())
        assert dashboard.errors.empty() and node.errors.empty()
        other = catalog.CLAIM.wildcard(node="gpu-b")
        await node.nc.subscribe(other)
        await node.nc.flush()
        await node.refused("subscription", other)
    finally:
        await dashboard.nc.close()
        await node.nc.close()
