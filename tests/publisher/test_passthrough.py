"""GPUs offered for VFIO passthrough too: one counter per GPU that its nvidia and its VFIO device consume."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from services.publisher import slices
from shared import featuregates, nodeconfig
from shared.events.inventory import NodeInventory
from tests.publisher.inventories import scan
from tests.publisher.test_slices import V134, V135, assert_valid, assert_valid_134, bodies


async def passthrough_node(tmp_path: Path) -> NodeInventory:
    """A simulated node whose discovery runs with PassthroughSupport on (an Alpha gate, off by default)."""
    inv = await scan(tmp_path, "n1", simulate="h100x2")
    return msgspec.structs.replace(inv, features={**inv.features, featuregates.PASSTHROUGH_SUPPORT: True})


@pytest.mark.parametrize("profile", [V134, V135], ids=["1.34", "1.35"])
async def test_every_gpu_and_its_vfio_twin_consume_one_passthrough_counter(tmp_path, profile) -> None:
    inv = await passthrough_node(tmp_path)
    pool = slices.desired_pools(inv, {}, slices.SliceOptions(passthrough=True), profile)[slices.GPU_DRIVER]
    devices = {d["name"]: d for s in pool.slices for d in s.devices}
    counters = {cs["name"]: cs["counters"] for s in pool.slices for cs in s.shared_counters}
    assert sorted(devices) == ["gpu-0", "gpu-1", "gpu-vfio-0", "gpu-vfio-1"]
    assert counters == {f"gpu-{i}-passthrough": {"gpu": {"value": "1"}} for i in (0, 1)}
    for i in (0, 1):
        for name in (f"gpu-{i}", f"gpu-vfio-{i}"):
            assert devices[name]["consumesCounters"] == [
                {"counterSet": f"gpu-{i}-passthrough", "counters": {"gpu": {"value": "1"}}}
            ]
    vfio = devices["gpu-vfio-1"]["attributes"]
    assert vfio["type"] == {"string": "vfio"} and vfio["uuid"] == devices["gpu-1"]["attributes"]["uuid"]
    for body in bodies(pool, profile):
        (assert_valid_134 if profile is V134 else assert_valid)(body)


async def test_a_node_config_rule_offers_passthrough_per_gpu_and_refuses_it_with_sharing(tmp_path) -> None:
    inv = await passthrough_node(tmp_path)
    config = nodeconfig.validate(
        nodeconfig.NodeConfig(spec=nodeconfig.NodeConfigSpec(rules=[nodeconfig.Rule(name="vm", passthrough=True)]))
    )
    settings = nodeconfig.resolve(config, {}, inv.gpus)
    pool = slices.desired_pools(inv, {}, slices.SliceOptions(), V135, settings)[slices.GPU_DRIVER]
    assert sorted(d["name"] for s in pool.slices for d in s.devices if d["name"].startswith("gpu-vfio")) == [
        "gpu-vfio-0",
        "gpu-vfio-1",
    ]
    without = slices.desired_pools(inv, {}, slices.SliceOptions(), V135)[slices.GPU_DRIVER]
    assert not any(
        d["name"].startswith("gpu-vfio") or "consumesCounters" in d for s in without.slices for d in s.devices
    )
    with pytest.raises(nodeconfig.NodeConfigError, match=r"spec.rules\[0\].passthrough"):
        nodeconfig.validate(
            nodeconfig.NodeConfig(
                spec=nodeconfig.NodeConfigSpec(
                    rules=[nodeconfig.Rule(name="vm", passthrough=True, sharing="timeSlicing")]
                )
            )
        )


async def test_a_node_whose_passthrough_gate_is_off_offers_no_vfio_device(tmp_path) -> None:
    inv = await scan(tmp_path, "n1", simulate="h100x2")  # the gate's default: off
    assert inv.features[featuregates.PASSTHROUGH_SUPPORT] is False
    pool = slices.desired_pools(inv, {}, slices.SliceOptions(passthrough=True), V135)[slices.GPU_DRIVER]
    assert sorted(d["name"] for s in pool.slices for d in s.devices) == ["gpu-0", "gpu-1"]
    assert not any("consumesCounters" in d for s in pool.slices for d in s.devices)
    on = await passthrough_node(tmp_path / "on")
    pool = slices.desired_pools(
        on,
        {},
        slices.SliceOptions(passthrough=True, disabled_features=frozenset({featuregates.PASSTHROUGH_SUPPORT})),
        V135,
    )[slices.GPU_DRIVER]
    assert sorted(d["name"] for s in pool.slices for d in s.devices) == ["gpu-0", "gpu-1"], "off in the publisher"
