"""The publisher end to end: real discovery (simulated NVML) -> real NATS -> publisher -> embedded API server."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

import msgspec
import pytest
from kubernetes_asyncio.client import CoreV1Api

import embedded.apiserver.testing as apiserver_testing
from embedded.apiserver.validation import validate_object
from embedded.harness.discovery import running_discovery
from embedded.harness.publisher import ensure_node, node_slices, running_publisher, until
from services.publisher import objects
from shared.bus import Bus
from shared.events import catalog
from shared.events.devices import InjectXidRequest
from shared.events.inventory import InventoryWithdrawn, NodeInventory
from shared.kube import rest as kube
from shared.kube.client import kube_api_client
from shared.telemetry import memory_spans, setup_telemetry
from tests.publisher.inventories import widened

running_apiserver = apiserver_testing.running_apiserver

setup_telemetry("tests", "memory")


@pytest.fixture
async def api(tmp_path):
    async with running_apiserver(tmp_path / "api") as server:
        client = await kube_api_client(str(server.kubeconfig_path))
        try:
            server.client_raw = client  # type: ignore[attr-defined]  # the tests' ApiClient, on the handle
            yield server
        finally:
            await client.close()


def taints(slices: list[dict]) -> dict[str, list[dict]]:
    return {d["name"]: d["taints"] for s in slices for d in s["spec"].get("devices", []) if d.get("taints")}


async def node_events(client, node: str) -> list[tuple[str, str, str]]:
    """(reason, type, message) of the publisher's Events about the node, oldest first."""
    listed = await CoreV1Api(client).list_namespaced_event("default")
    return [
        (e.reason, e.type, e.message)
        for e in sorted(listed.items, key=lambda e: int(e.metadata.resource_version))
        if e.involved_object.kind == "Node"
        and e.involved_object.name == node
        and e.source.component == "gpu-dra-publisher"
    ]


async def inject(bus: Bus, node: str, uuid: str, **what) -> None:
    reply = await bus.request(catalog.DEVICE_INJECT_XID, InjectXidRequest(gpu_uuid=uuid, **what), node=node)
    assert reply.ok, reply


async def test_h100x8_slices_validate_and_a_noop_resync_writes_nothing(bus, api, nats_server, tmp_path):
    client = api.client_raw
    uid = await ensure_node(client, "n1")
    # The publisher first, so the inventory reaches it as an event (whose trace the write continues).
    async with running_publisher(nats_server.url, str(api.kubeconfig_path)) as pub:
        async with running_discovery(bus, node="n1", simulate="h100x8", root=tmp_path / "sim"):
            await until(pub, lambda: _has_slices(client, "n1", 1))
            await until(pub, lambda: _has_slices(client, "n1", 1, driver="compute-domain.nvidia.com"))
            [gpu_slice] = await node_slices(client, "n1")
            assert validate_object("resource.k8s.io", "v1", "ResourceSlice", gpu_slice) == []
            assert [d["name"] for d in gpu_slice["spec"]["devices"]] == [f"gpu-{i}" for i in range(8)]
            assert gpu_slice["spec"]["pool"]["resourceSliceCount"] == 1
            assert gpu_slice["metadata"]["ownerReferences"][0]["uid"] == uid
            writes = pub.stats.writes
            assert writes == 2  # one GPU slice and one compute-domain slice
            await pub.resync()
            await pub.idle()
            assert pub.stats.writes == writes  # the no-op resync wrote nothing
            assert pub.syncs >= 2

    spans = memory_spans()
    sync = [s for s in spans if s.name == "publisher.sync-node" and (s.attributes or {}).get("publisher.writes")]
    discovery_traces = {s.context.trace_id for s in spans if s.name == "discovery.publish-inventory"}
    assert any(s.context.trace_id in discovery_traces for s in sync), "the write continues discovery's trace"
    posts = [s for s in spans if s.name == "POST resourceslice"]
    assert any(p.parent is not None and p.parent.span_id in {s.context.span_id for s in sync} for p in posts)


async def _has_slices(client, node: str, count: int, driver: str = "gpu.nvidia.com") -> bool:
    return len(await node_slices(client, node, driver)) == count


async def test_xid_taints_survive_a_publisher_restart_and_recovery_clears_them(bus, api, nats_server, tmp_path):
    client = api.client_raw
    await ensure_node(client, "n1")
    async with running_discovery(bus, node="n1", simulate="h100x8", root=tmp_path / "sim") as disc:
        uuid = disc.inventory.gpus[2].uuid
        async with running_publisher(nats_server.url, str(api.kubeconfig_path), taint_effect="NoExecute") as pub:
            await until(pub, lambda: _has_slices(client, "n1", 1))
            await inject(bus, "n1", uuid, xid=79)

            async def tainted() -> bool:
                return "gpu-2" in taints(await node_slices(client, "n1"))

            await until(pub, tainted)
            [taint] = taints(await node_slices(client, "n1"))["gpu-2"]
            assert (taint["key"], taint["value"], taint["effect"]) == ("gpu.nvidia.com/xid", "79", "NoExecute")
            before = await node_slices(client, "n1")
            assert await node_events(client, "n1") == [
                (
                    "DeviceTaintAdded",
                    "Warning",
                    "taint gpu.nvidia.com/xid=79:NoExecute added to device "
                    "gpu.nvidia.com/gpu-2 in the node's ResourceSlices",
                )
            ]

        async with running_publisher(nats_server.url, str(api.kubeconfig_path), taint_effect="NoExecute") as pub:
            await pub.idle()
            assert pub.stats.writes == 0  # the restarted publisher finds the taint already right (from KV)
            assert await node_slices(client, "n1") == before
            await inject(bus, "n1", uuid, recover=True)

            async def clear() -> bool:
                return taints(await node_slices(client, "n1")) == {}

            await until(pub, clear)
            assert (await node_events(client, "n1"))[1:] == [  # the restart's first sync only recorded
                (
                    "DeviceTaintRemoved",
                    "Normal",
                    "taint gpu.nvidia.com/xid=79:NoExecute removed from device "
                    "gpu.nvidia.com/gpu-2 in the node's ResourceSlices",
                )
            ]
            [after] = await node_slices(client, "n1")
            assert after["spec"]["pool"]["generation"] == before[0]["spec"]["pool"]["generation"] + 1


async def test_slices_go_when_the_inventory_is_withdrawn(bus, api, nats_server, tmp_path):
    client = api.client_raw
    for node in ("n1", "n2"):
        await ensure_node(client, node)
    async with (
        running_discovery(bus, node="n1", simulate="h100x2", root=tmp_path / "sim"),
        running_discovery(bus, node="n2", simulate="l40sx1", root=tmp_path / "sim"),
        running_publisher(nats_server.url, str(api.kubeconfig_path)) as pub,
    ):
        await until(pub, lambda: _has_slices(client, "n1", 1))
        await until(pub, lambda: _has_slices(client, "n2", 1))
        await bus.publish(catalog.INVENTORY_WITHDRAWN, InventoryWithdrawn(node="n1", reason="drained"), node="n1")

        async def n1_gone() -> bool:
            return await _has_slices(client, "n1", 0) and await _has_slices(
                client, "n1", 0, driver="compute-domain.nvidia.com"
            )

        await until(pub, n1_gone)


async def test_a_deleted_nodes_slices_go_only_after_the_grace(bus, api, nats_server, tmp_path):
    """The Node is deleted without cascading to its slices (orphan propagation): the publisher keeps them
    for --node-gone-grace, in case the Node comes back, then deletes them."""
    client = api.client_raw
    await ensure_node(client, "n2")
    async with (
        running_discovery(bus, node="n2", simulate="l40sx1", root=tmp_path / "sim"),
        running_publisher(nats_server.url, str(api.kubeconfig_path), compute_domains=False, node_gone_grace=1.5) as pub,
    ):
        await until(pub, lambda: _has_slices(client, "n2", 1))
        synced = pub.next_sync()
        await kube.request(client, "DELETE", "/api/v1/nodes/n2", query=[("propagationPolicy", "Orphan")])
        deleted_at = time.monotonic()
        await asyncio.wait_for(synced.wait(), 10)  # the sync the Node's removal caused
        await pub.idle()
        assert await _has_slices(client, "n2", 1), "deleted before the grace ran out"
        await until(pub, lambda: _has_slices(client, "n2", 0))
        assert time.monotonic() - deleted_at >= 1.5


async def _seed_two_nodes(bus, client, tmp_path) -> dict[str, NodeInventory]:
    async with running_discovery(bus, node="seed", simulate="h100x2", root=tmp_path / "seed") as disc:
        seed = disc.inventory
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    out = {}
    for node in ("n1", "n2"):
        await ensure_node(client, node)
        out[node] = msgspec.structs.replace(seed, node=node)
        await kv.put(node, out[node])
    return out


async def _all_slices(client) -> list[dict]:
    return await node_slices(client, "n1") + await node_slices(client, "n2")


async def test_a_publisher_restarted_through_a_nats_outage_with_kv_read_empty_deletes_nothing(
    bus, api, nats_server, tmp_path
):
    client = api.client_raw
    await _seed_two_nodes(bus, client, tmp_path)
    url, kubeconfig = nats_server.url, str(api.kubeconfig_path)
    async with running_publisher(url, kubeconfig, compute_domains=False) as pub:
        await until(pub, lambda: _has_slices(client, "n1", 1))
        await until(pub, lambda: _has_slices(client, "n2", 1))
    before = await _all_slices(client)
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    for node in ("n1", "n2"):  # what a read during the outage gives: nothing
        await kv.delete(node)
    await nats_server.restart()
    async with running_publisher(url, kubeconfig, compute_domains=False) as pub:
        await pub.idle()
        await pub.resync()
        await pub.idle()
        assert pub.stats.deletes == 0 and pub.stats.writes == 0
        assert await _all_slices(client) == before


async def test_garbage_in_a_nodes_inventory_key_keeps_its_slices_and_discovery_restores_the_key(
    bus, api, nats_server, tmp_path
):
    client = api.client_raw
    await _seed_two_nodes(bus, client, tmp_path)
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    async with (
        running_discovery(bus, node="n3", simulate="l40sx1", root=tmp_path / "sim") as disc,
        running_publisher(nats_server.url, str(api.kubeconfig_path), compute_domains=False) as pub,
    ):
        await ensure_node(client, "n3")
        for node in ("n1", "n2", "n3"):
            await until(pub, lambda: _has_slices(client, node, 1))  # noqa: B023 - awaited here
        before = {node: await node_slices(client, node) for node in ("n1", "n2", "n3")}

        # n1 has no discovery running: the garbage stays, and the publisher keeps n1's slices.
        await bus.nc.publish("$KV.dra-inventory.n1", b"\x00not an inventory{")
        # n3's discovery sees its key change under it and writes its true inventory back.
        async with asyncio.timeout(5):
            value = await disc.overwrite_key(bus, b"garbage")
        assert value.content_hash == disc.inventory.content_hash
        assert disc.service.key_repairs == 1
        assert await kv.get("n1") is None  # unreadable
        await pub.resync()
        await pub.idle()
        assert pub.stats.deletes == 0
        for node in ("n1", "n2", "n3"):
            assert await node_slices(client, node) == before[node]


async def test_a_129_device_node_is_published_as_two_slices(bus, api, nats_server, tmp_path):
    client = api.client_raw
    await ensure_node(client, "big")
    async with running_discovery(bus, node="seed", simulate="h100x1", root=tmp_path / "sim") as disc:
        big = widened(disc.inventory, 129, node="big")
    async with running_publisher(nats_server.url, str(api.kubeconfig_path), compute_domains=False) as pub:
        await (await bus.kv(catalog.INVENTORY_BUCKET)).put("big", big)
        await bus.publish(catalog.INVENTORY, big, node="big")
        await until(pub, lambda: _has_slices(client, "big", 2))
        stored = await node_slices(client, "big")
        assert [len(s["spec"]["devices"]) for s in stored] == [128, 1]
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in stored} == {2}
        assert len({s["spec"]["pool"]["generation"] for s in stored}) == 1


async def test_dynamic_mig_counters_only_layout_is_accepted(bus, api, nats_server, tmp_path):
    client = api.client_raw
    await ensure_node(client, "n1")
    async with (
        running_discovery(bus, node="n1", simulate="h100x2", root=tmp_path / "sim"),
        running_publisher(
            nats_server.url, str(api.kubeconfig_path), mig_mode="dynamic", counter_layout="counters-only-slice"
        ) as pub,
    ):
        await until(pub, lambda: _has_slices(client, "n1", 3))
        stored = await node_slices(client, "n1")
        head = stored[0]["spec"]
        assert [cs["name"] for cs in head["sharedCounters"]] == ["gpu-0-counter-set", "gpu-1-counter-set"]
        assert "devices" not in head
        names = {d["name"] for s in stored[1:] for d in s["spec"]["devices"]}
        assert {"gpu-0", "gpu-1", "gpu-0-mig-1g10gb-19-0", "gpu-1-mig-7g80gb-0-0"} <= names


async def test_conflicts_and_external_edits_are_read_again_and_repaired(bus, api, nats_server, tmp_path):
    client = api.client_raw
    await ensure_node(client, "n1")
    async with (
        running_discovery(bus, node="n1", simulate="h100x1", root=tmp_path / "sim"),
        running_publisher(nats_server.url, str(api.kubeconfig_path), compute_domains=False) as pub,
    ):
        await until(pub, lambda: _has_slices(client, "n1", 1))
        [stored] = await node_slices(client, "n1")
        # Someone else edits the slice: the publisher's cached resourceVersion is now stale.
        stored["spec"]["devices"][0]["attributes"]["productName"] = {"string": "tampered"}
        stored["metadata"]["annotations"][objects.HASH_ANNOTATION] = "tampered"
        path = f"/apis/resource.k8s.io/v1/resourceslices/{stored['metadata']['name']}"
        await kube.request(client, "PUT", path, body=stored)
        assert pub.writer is not None
        cached = pub.writer.store.pool("gpu.nvidia.com", "n1")[stored["metadata"]["name"]]
        assert objects.HASH_ANNOTATION in cached.metadata.annotations
        # Force a change so the publisher writes with its stale resourceVersion: 409, re-read, retry.
        cached.metadata.annotations[objects.HASH_ANNOTATION] = "stale-cache"
        stats = await asyncio.wait_for(pub.sync_node("n1"), 20)
        assert stats.conflicts == 1 and stats.updates == 1
        [repaired] = await node_slices(client, "n1")
        assert repaired["spec"]["devices"][0]["attributes"]["productName"] != {"string": "tampered"}
        assert repaired["spec"]["pool"]["generation"] == stored["spec"]["pool"]["generation"] + 1


async def test_an_inventory_missed_while_nats_was_away_is_read_from_kv_on_reconnect(bus, api, nats_server, tmp_path):
    """The inventory subscription is core NATS: what is published while the connection is down (its NATS
    node lost) never arrives. On reconnect the publisher re-reads KV, as at start, instead of waiting for
    the periodic resync (an hour here)."""
    client = api.client_raw
    await ensure_node(client, "n1")
    async with running_discovery(bus, node="seed", simulate="h100x2", root=tmp_path / "sim") as disc:
        seed = disc.inventory
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    await kv.put("n1", msgspec.structs.replace(seed, node="n1"))
    async with running_publisher(nats_server.url, str(api.kubeconfig_path), compute_domains=False) as pub:

        async def devices() -> int:
            return sum(len(s["spec"].get("devices") or []) for s in await node_slices(client, "n1"))

        await until(pub, lambda: _equals(devices(), 2))
        # the value a discovery wrote whose event the publisher did not hear
        await kv.put(
            "n1", msgspec.structs.replace(seed, node="n1", gpus=seed.gpus[:1], observed_at=seed.observed_at + 1)
        )
        await nats_server.restart()
        await until(pub, lambda: _equals(devices(), 1), timeout=30)


async def _equals(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def test_a_crashed_replica_hands_its_nodes_over(bus, api, nats_server, tmp_path):
    client = api.client_raw
    nodes = [f"n{i}" for i in range(6)]
    for node in nodes:
        await ensure_node(client, node)
    async with running_discovery(bus, node="seed", simulate="h100x1", root=tmp_path / "sim") as disc:
        seed = disc.inventory
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    for node in nodes:
        await kv.put(node, msgspec.structs.replace(seed, node=node))
    url, kubeconfig = nats_server.url, str(api.kubeconfig_path)
    lease = 2.0  # the changes below reach a well before it counts b as gone
    # a takes b for gone by its lease alone (no presence probes, which would see b's stop at once)
    async with running_publisher(
        url, kubeconfig, replica_id="a", compute_domains=False, lease_seconds=lease, probe_seconds=0
    ) as a:
        async with running_publisher(
            url, kubeconfig, replica_id="b", compute_domains=False, clean_stop=False, lease_seconds=lease
        ) as b:
            await a.membership.wait_for({"a", "b"})
            await b.membership.wait_for({"a", "b"})
            for node in nodes:
                await until(a, lambda: _has_slices(client, node, 1))  # noqa: B023 - awaited here
            b_nodes = [n for n in nodes if b.membership.owns(n)]
            assert b_nodes and not any(a.membership.owns(n) for n in b_nodes)
            # each replica holds the inventories of its own nodes only; of the others, the names
            seed_node = {"seed"}  # the simulated discovery's own inventory, in KV too
            assert set(a.state.inventory) - seed_node == set(nodes) - set(b_nodes)
            assert set(b.state.inventory) - seed_node == set(b_nodes)
            assert a.state.nodes() - seed_node == set(nodes)
        # b died without a word. Two of its nodes change before its lease runs out (no live owner): a takes the
        # most recently changed first, then the older change, then the nodes that did not change.
        queued: list[str] = []
        add = a.queue.add

        def recording(node: str, cause: Any = None) -> None:
            queued.append(node)
            add(node, cause)

        a.queue.add = recording  # type: ignore[method-assign,assignment]
        for node in (b_nodes[2], b_nodes[1]):
            newer = msgspec.structs.replace(seed, node=node, driver_version="999.1", observed_at=time.time())
            await kv.put(node, newer)
            await bus.publish(catalog.INVENTORY, newer, node=node)
        await a.membership.wait_for({"a"})

        async def all_queued() -> bool:
            return set(b_nodes) <= set(queued)

        await until(a, all_queued)
        assert [n for n in queued if n in b_nodes][:2] == [b_nodes[1], b_nodes[2]], queued
        # once its lease runs out, a owns b's nodes and publishes their changes
        changed = msgspec.structs.replace(seed, node=b_nodes[0], gpus=seed.gpus * 0)
        await kv.put(b_nodes[0], changed)
        await bus.publish(catalog.INVENTORY, changed, node=b_nodes[0])

        async def emptied() -> bool:
            stored = await node_slices(client, b_nodes[0])
            return len(stored) == 1 and not stored[0]["spec"].get("devices")

        await until(a, emptied)
        # a read b's inventories back from KV and b's slices from the server before writing: no blind
        # create that the server refuses, no node left unsynced
        await a.idle()
        assert set(a.state.inventory) - {"seed"} == set(nodes)
        assert a.stats.conflicts == 0
        for node in b_nodes[1:]:
            assert await _has_slices(client, node, 1)


async def test_the_initial_bulk_logs_one_line_and_later_writes_a_line_each(bus, api, nats_server, tmp_path, caplog):
    client = api.client_raw
    for node in ("n1", "n2"):
        await ensure_node(client, node)
    with caplog.at_level(logging.INFO, logger="services.publisher.service"):
        async with (
            running_discovery(bus, node="n1", simulate="h100x2", root=tmp_path / "n1"),
            running_discovery(bus, node="n2", simulate="l40sx1", root=tmp_path / "n2"),
        ):
            async with running_publisher(nats_server.url, str(api.kubeconfig_path)) as pub:  # both in KV already
                await until(pub, lambda: _has_slices(client, "n1", 1))
                await until(pub, lambda: _has_slices(client, "n2", 1))
                await pub.idle()
                bulk = [r for r in caplog.records if r.getMessage() == "initial slices written"]
                assert [(r.structured_fields["nodes_written"], r.structured_fields["creates"]) for r in bulk] == [
                    (2, 4)
                ]
                assert not [r for r in caplog.records if r.getMessage() == "slices written"]
                await bus.publish(
                    catalog.INVENTORY_WITHDRAWN, InventoryWithdrawn(node="n1", reason="drained"), node="n1"
                )
                await until(pub, lambda: _has_slices(client, "n1", 0))
                await pub.idle()
    later = [r.structured_fields for r in caplog.records if r.getMessage() == "slices written"]
    assert later and later[0]["node"] == "n1" and later[0]["deletes"] >= 1
