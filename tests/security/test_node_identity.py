"""A node speaks only for itself: attacks by node gpu-a's own NATS users (the shipped permissions
let them publish only gpu-a's subjects and KV keys) on node gpu-b, through the bodies they write.

Each attack is played against the real publisher (the `publisher` user) writing ResourceSlices to
the embedded API server, and asserted to have no effect on gpu-b; the refusal is awaited as its
dead letter (reason `identity-mismatch`) and read back from the metric.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import REGISTRY

from embedded.harness.discovery import running_discovery
from embedded.harness.publisher import ensure_node, node_slices, running_publisher, until
from services.computedomain.membership import Membership
from services.publisher.service import Publisher
from shared.bus import Bus
from shared.events import catalog
from shared.events.computedomain import DomainMember
from shared.events.health import DeviceHealth
from shared.identity import REASON
from shared.natsserver import EmbeddedNats
from tests.security.conftest import DeadLetters, bus_as, url_as


def mismatches(consumer: str, kind: str) -> float:
    return (
        REGISTRY.get_sample_value("gpu_dra_identity_mismatch_total", {"consumer": consumer, "subject_kind": kind})
        or 0.0
    )


def device_names(slices: list[dict[str, Any]]) -> list[str]:
    return [d["name"] for s in slices for d in s["spec"].get("devices", [])]


def taints(slices: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {d["name"]: d["taints"] for s in slices for d in s["spec"].get("devices", []) if d.get("taints")}


async def _publishing_gpu_b(pub: Publisher, client: Any) -> list[dict[str, Any]]:
    async def has_slices() -> bool:
        return len(device_names(await node_slices(client, "gpu-b"))) == 4

    await until(pub, has_slices)
    return await node_slices(client, "gpu-b")


async def test_an_inventory_naming_another_node_does_not_touch_its_slices(
    shipped_nats: EmbeddedNats, api: Any, dead_letters: DeadLetters, tmp_path: Path
) -> None:
    client = api.client_raw
    for node in ("gpu-a", "gpu-b"):
        await ensure_node(client, node)
    async with (
        bus_as(shipped_nats, "discovery.gpu-b") as disc_b,
        bus_as(shipped_nats, "discovery.gpu-a") as attacker,
        running_discovery(disc_b, node="gpu-b", simulate="h100x4", root=tmp_path / "sim") as real_b,
    ):
        async with running_publisher(url_as(shipped_nats, "publisher"), str(api.kubeconfig_path)) as pub:
            before = await _publishing_gpu_b(pub, client)
            consumer = pub.bus.name
            counted = mismatches(consumer, "inventory"), mismatches(consumer, "dra-inventory")

            # gpu-a's discovery, on its own subject and KV key, says gpu-b has one GPU
            forged = msgspec.structs.replace(real_b.inventory, gpus=real_b.inventory.gpus[:1], content_hash="forged")
            await (await attacker.kv(catalog.INVENTORY_BUCKET)).put("gpu-a", forged)
            await attacker.publish(catalog.INVENTORY, forged, node="gpu-a")

            letter = await dead_letters.next(reason=REASON, subject=catalog.INVENTORY.format(node="gpu-a"))
            assert "gpu-b" in letter.error and "gpu-a" in letter.error
            assert letter.consumer == consumer
            # a resync reads the forged KV value: refused as well, once
            await pub.resync()
            await dead_letters.next(reason=REASON, subject="$KV.dra-inventory.gpu-a")
            await pub.resync()
            await pub.idle()
            assert mismatches(consumer, "inventory") == counted[0] + 1
            assert mismatches(consumer, "dra-inventory") == counted[1] + 1
            assert len(pub.state.inventory["gpu-b"].gpus) == 4
            assert "gpu-a" not in pub.state.inventory
            assert await node_slices(client, "gpu-b") == before
            assert await node_slices(client, "gpu-a") == []

        # a restarted publisher (it reads every node's KV value first) keeps gpu-b as it is
        async with running_publisher(url_as(shipped_nats, "publisher"), str(api.kubeconfig_path)) as pub:
            await pub.idle()
            await dead_letters.next(reason=REASON, subject="$KV.dra-inventory.gpu-a")
            assert pub.stats.writes == 0
            assert await node_slices(client, "gpu-b") == before


async def test_health_naming_another_nodes_gpus_taints_nothing(
    shipped_nats: EmbeddedNats, api: Any, dead_letters: DeadLetters, tmp_path: Path
) -> None:
    client = api.client_raw
    await ensure_node(client, "gpu-b")
    async with (
        bus_as(shipped_nats, "discovery.gpu-b") as disc_b,
        bus_as(shipped_nats, "discovery.gpu-a") as attacker,
        running_discovery(disc_b, node="gpu-b", simulate="h100x4", root=tmp_path / "sim"),
        running_publisher(url_as(shipped_nats, "publisher"), str(api.kubeconfig_path), taint_effect="NoExecute") as pub,
    ):
        before = await _publishing_gpu_b(pub, client)
        counted = mismatches(pub.bus.name, "device-health")
        forged = DeviceHealth(
            node="gpu-b", device="gpu-2", state="Unhealthy", reason="xid", xid=79, event_id="forged", observed_at=9e9
        )
        await (await attacker.kv(catalog.HEALTH_BUCKET)).put("gpu-a.gpu-2", forged)
        await attacker.publish(catalog.HEALTH, forged, node="gpu-a", device="gpu-2")
        await dead_letters.next(reason=REASON, subject=catalog.HEALTH.format(node="gpu-a", device="gpu-2"))
        await pub.resync()
        await dead_letters.next(reason=REASON, subject="$KV.dra-health.gpu-a.gpu-2")
        await pub.idle()
        assert mismatches(pub.bus.name, "device-health") == counted + 1
        assert await node_slices(client, "gpu-b") == before
        assert taints(before) == {}

        # the same report from gpu-b's own discovery user does taint: the path the attack took is live
        real = msgspec.structs.replace(forged, event_id="real", observed_at=1.0)
        await (await disc_b.kv(catalog.HEALTH_BUCKET)).put("gpu-b.gpu-2", real)
        await disc_b.publish(catalog.HEALTH, real, node="gpu-b", device="gpu-2")

        async def tainted() -> bool:
            return list(taints(await node_slices(client, "gpu-b"))) == ["gpu-2"]

        await until(pub, tainted)


async def test_a_membership_value_naming_another_node_is_not_a_member(
    shipped_nats: EmbeddedNats, admin_bus: Bus, dead_letters: DeadLetters
) -> None:
    async with bus_as(shipped_nats, "cd-agent.gpu-a") as attacker, bus_as(shipped_nats, "cd-agent.gpu-b") as agent_b:
        honest = DomainMember(
            domain_uid="cd-1",
            domain_name="d",
            domain_namespace="team-b",
            node="gpu-b",
            ip_address="10.0.0.2",
            clique_id="",
            index=-1,
        )
        await (await agent_b.kv(catalog.CD_MEMBERS_BUCKET)).put("cd-1.gpu-b", honest)
        # gpu-a's agent, under its own key, claims to be gpu-b with another address
        forged = msgspec.structs.replace(honest, ip_address="10.6.6.6")
        await (await attacker.kv(catalog.CD_MEMBERS_BUCKET)).put("cd-1.gpu-a", forged)
        members = await Membership(admin_bus).members("cd-1")
        assert {node: m.ip_address for node, m in members.items()} == {"gpu-b": "10.0.0.2"}
        await dead_letters.next(reason=REASON, subject="$KV.dra-cd-members.cd-1.gpu-a")


async def test_discovery_restores_its_own_key_under_its_shipped_permissions(
    shipped_nats: EmbeddedNats, admin_bus: Bus, tmp_path: Path
) -> None:
    """The key guard needs only what discovery.<node> may do: watch and write its own key."""
    async with (
        bus_as(shipped_nats, "discovery.gpu-b") as disc_b,
        running_discovery(disc_b, node="gpu-b", simulate="h100x1", root=tmp_path / "sim") as real_b,
    ):
        async with asyncio.timeout(5):
            value = await real_b.overwrite_key(admin_bus, b"{not json")
        assert value.content_hash == real_b.inventory.content_hash
        assert real_b.service.key_repairs == 1
