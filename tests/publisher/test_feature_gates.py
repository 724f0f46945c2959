"""Feature gates in the published slices: a gate off in one node's discovery takes that node's gated devices
out of its slices (and only that node's); a gate off in the publisher takes them out everywhere."""

from __future__ import annotations

import time

import msgspec

import embedded.apiserver.testing as apiserver_testing
from embedded.harness.discovery import running_discovery
from embedded.harness.publisher import ensure_node, node_slices, running_publisher, until
from services.publisher import slices
from shared import featuregates
from tests.publisher.inventories import scan
from tests.publisher.test_shares import STATIC, settings_for
from tests.publisher.test_slices import V134

running_apiserver = apiserver_testing.running_apiserver


def _names(stored: list[dict]) -> set[str]:
    return {d["name"] for s in stored for d in s["spec"].get("devices", [])}


def _has_mig(stored: list[dict]) -> bool:
    return any("-mig-" in name for name in _names(stored))


async def test_dynamic_mig_off_on_one_node_drops_its_partitions_within_a_second(bus, nats_server, tmp_path):
    async with running_apiserver(tmp_path / "api") as api:
        from shared.kube.client import kube_api_client

        client = await kube_api_client(str(api.kubeconfig_path))
        try:
            for node in ("n1", "n2"):
                await ensure_node(client, node)
            async with (
                running_publisher(
                    nats_server.url, str(api.kubeconfig_path), mig_mode="dynamic", counter_layout="counters-only-slice"
                ) as pub,
                running_discovery(bus, node="n2", simulate="h100x2", root=tmp_path / "sim"),
            ):
                async with running_discovery(bus, node="n1", simulate="h100x2", root=tmp_path / "sim"):

                    async def both_dynamic() -> bool:
                        return all([_has_mig(await node_slices(client, n)) for n in ("n1", "n2")])

                    await until(pub, both_dynamic)
                    other = await node_slices(client, "n2")
                # n1's discovery comes back with the gate off: the operator staging it on that node only
                async with running_discovery(
                    bus, node="n1", simulate="h100x2", root=tmp_path / "sim", feature_gates="DynamicMIG=false"
                ) as disc:
                    assert disc.inventory.features[featuregates.DYNAMIC_MIG] is False
                    started = time.monotonic()

                    async def n1_static() -> bool:
                        stored = await node_slices(client, "n1")
                        return bool(stored) and not _has_mig(stored)

                    await until(pub, n1_static, timeout=5.0)
                    elapsed = time.monotonic() - started
                    assert _names(await node_slices(client, "n1")) == {"gpu-0", "gpu-1"}
                    assert await node_slices(client, "n2") == other  # unchanged, resourceVersion and all
        finally:
            await client.close()
    assert elapsed <= 1.0, f"n1's slices lost its dynamic MIG devices {elapsed:.3f} s after its inventory"


async def test_shares_off_on_a_node_offer_its_gpus_whole(tmp_path):
    inv = await scan(tmp_path, "n1", simulate="h100x8")
    settings = settings_for("mps-shares.yaml", inv)
    shared_pool = slices.gpu_pool(inv, {}, STATIC, V134, settings)
    assert all(d.get("allowMultipleAllocations") for s in shared_pool.slices for d in s.devices)
    off = msgspec.structs.replace(inv, features={featuregates.CONSUMABLE_SHARES: False})
    whole = slices.gpu_pool(off, {}, STATIC, V134, settings)
    assert not any(d.get("allowMultipleAllocations") for s in whole.slices for d in s.devices)
    assert any(featuregates.CONSUMABLE_SHARES in note for note in whole.notes)
    plain = slices.gpu_pool(inv, {}, STATIC, V134, None)
    assert whole.slices == plain.slices  # exactly what a node without shares publishes


async def test_a_gate_off_in_the_publisher_is_off_on_every_node(tmp_path):
    inv = await scan(tmp_path, "n1", simulate="h100x2")
    dynamic = slices.SliceOptions(mig_mode="dynamic")
    assert any("-mig-" in d["name"] for s in slices.gpu_pool(inv, {}, dynamic, V134).slices for d in s.devices)
    gated = slices.SliceOptions(mig_mode="dynamic", disabled_features=frozenset({featuregates.DYNAMIC_MIG}))
    pool = slices.gpu_pool(inv, {}, gated, V134)
    assert [d["name"] for s in pool.slices for d in s.devices] == ["gpu-0", "gpu-1"]
    assert any(featuregates.DYNAMIC_MIG in note for note in pool.notes)
