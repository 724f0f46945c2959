"""Inventory + health -> slices (pure): device modes, taints, compute domains, splitting, wire forms."""

from __future__ import annotations

import kubernetes_validate
import pytest

from embedded.apiserver.validation import validate_object
from services.publisher import objects, slices, split
from services.publisher.apiversion import ServerProfile
from shared.events.health import DeviceHealth
from tests.publisher.inventories import STATIC_MIG_MACHINE, scan, widened

V134 = ServerProfile(minor=34, counter_layout="beside-devices")
V135 = ServerProfile(minor=35, counter_layout="counters-only-slice")
V133_BETA = ServerProfile(api_version="v1beta1", minor=33, counter_layout="beside-devices")
STATIC = slices.SliceOptions()
DYNAMIC = slices.SliceOptions(mig_mode="dynamic")


def bodies(pool: slices.DesiredPool, profile: ServerProfile, generation: int = 1) -> list[dict]:
    return [r.body(generation, profile) for r in objects.render(pool, "0b6f3c1e-node-uid")]


def assert_valid(body: dict, version: str = "v1") -> None:
    errors = validate_object("resource.k8s.io", version, "ResourceSlice", body)
    assert errors == [], [str(e) for e in errors]


def assert_valid_134(body: dict) -> None:
    """The 1.34 schema; the embedded server's validator applies 1.35+ rules (devices or counters, not both)."""
    kubernetes_validate.validate(body, "1.34.0", strict=True)
    assert len(body["spec"].get("devices", [])) <= 128
    assert sum(len(cs["counters"]) for cs in body["spec"].get("sharedCounters", [])) <= 32


@pytest.fixture
async def h100(tmp_path):
    return await scan(tmp_path, "n1", simulate="h100x8")


async def test_h100x8_full_gpus_match_the_reference_and_validate(h100):
    pools = slices.desired_pools(h100, {}, STATIC, V134)
    gpu = pools[slices.GPU_DRIVER]
    assert [len(s.devices) for s in gpu.slices] == [8]
    [body] = bodies(gpu, V134)
    assert_valid(body)
    spec = body["spec"]
    assert spec["driver"] == "gpu.nvidia.com" and spec["nodeName"] == "n1"
    assert spec["pool"] == {"name": "n1", "generation": 1, "resourceSliceCount": 1}
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "0b6f3c1e-node-uid", "controller": True}
    ]
    devices = {d["name"]: d for d in spec["devices"]}
    assert sorted(devices) == [f"gpu-{i}" for i in range(8)]
    d0 = devices["gpu-0"]
    g0 = h100.gpus[0]
    assert d0["attributes"]["type"] == {"string": "gpu"}
    assert d0["attributes"]["uuid"] == {"string": g0.uuid}
    assert d0["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert d0["attributes"]["architecture"] == {"string": "Hopper"}
    assert d0["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
    assert d0["attributes"]["driverVersion"] == {"version": h100.driver_version}
    assert d0["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": g0.pci_bus_id}
    assert "index" not in d0["attributes"]  # removed upstream (#563)
    assert d0["capacity"] == {"memory": {"value": "80Gi"}}
    assert len(d0["attributes"]) + len(d0["capacity"]) <= 32


async def test_compute_domain_slice_has_channel_and_daemon_with_the_clique(tmp_path):
    inv = await scan(tmp_path, "n1", simulate="gb200x4")
    pool = slices.desired_pools(inv, {}, STATIC, V134)[slices.CD_DRIVER]
    [body] = bodies(pool, V134)
    assert_valid(body)
    names = [d["name"] for d in body["spec"]["devices"]]
    assert names == ["channel-0", "daemon-0"]
    channel = body["spec"]["devices"][0]["attributes"]
    fabric = inv.gpus[0].fabric
    assert fabric is not None
    assert channel["type"] == {"string": "channel"} and channel["id"] == {"int": 0}
    assert channel[slices.CLIQUE_ATTRIBUTE] == {"string": f"{fabric.cluster_uuid}.{fabric.clique_id}"}


async def test_no_clique_attribute_without_fabric_and_no_cd_pool_when_disabled(h100):
    pools = slices.desired_pools(h100, {}, STATIC, V134)
    if all(g.fabric is None for g in h100.gpus):
        assert slices.CLIQUE_ATTRIBUTE not in pools[slices.CD_DRIVER].slices[0].devices[0]["attributes"]
    off = slices.desired_pools(h100, {}, slices.SliceOptions(compute_domains=False), V134)
    assert slices.CD_DRIVER not in off


async def test_static_mig_gpu_advertises_its_mig_devices_not_itself(tmp_path):
    inv = await scan(tmp_path, "n1", machine=STATIC_MIG_MACHINE)
    pool = slices.desired_pools(inv, {}, STATIC, V134)[slices.GPU_DRIVER]
    [body] = bodies(pool, V134)
    assert_valid(body)
    devices = {d["name"]: d for d in body["spec"]["devices"]}
    assert sorted(devices) == [
        "gpu-0-mig-1g5gb-19-0",
        "gpu-0-mig-1g5gb-19-1",
        "gpu-0-mig-2g10gb-14-2",
        "gpu-0-mig-3g20gb-9-4",
        "gpu-1",
    ]
    mig = devices["gpu-0-mig-2g10gb-14-2"]
    assert mig["attributes"]["type"] == {"string": "mig"}
    assert mig["attributes"]["profile"] == {"string": "2g.10gb"}
    assert mig["attributes"]["parentUUID"] == {"string": inv.gpus[0].uuid}
    assert mig["attributes"]["uuid"]["string"].startswith("MIG-")
    assert {k for k in mig["capacity"] if k.startswith("memorySlice")} == {"memorySlice2", "memorySlice3"}
    assert "consumesCounters" not in mig


async def test_a_mig_gpu_without_mig_devices_is_offered_as_nvidias_driver_offers_it(tmp_path):
    """NVIDIA's driver (gpu-kubelet-plugin nvlib.go): in static MIG mode such a GPU has nothing allocatable (a
    warning: stranded capacity); with DynamicMIG its placements are offered against its counter set, and the
    GPU itself only where MIG can be toggled without a reset (Hopper on; not this A100)."""
    machine = {
        "gpus": [
            {"profile": "a100-40gb", "count": 1, "mig_enabled": True, "mig_devices": []},
            {"profile": "a100-40gb", "count": 1},
        ]
    }
    inv = await scan(tmp_path, "n1", machine=machine)
    static = slices.desired_pools(inv, {}, STATIC, V134)[slices.GPU_DRIVER]
    assert [d["name"] for s in static.slices for d in s.devices] == ["gpu-1"]
    assert any("gpu-0 has MIG mode enabled but no configured MIG devices" in n for n in static.notes)
    dynamic = slices.desired_pools(inv, {}, DYNAMIC, V134)[slices.GPU_DRIVER]
    names = [d["name"] for s in dynamic.slices for d in s.devices]
    assert "gpu-0" not in names and "gpu-1" in names
    placements = [n for n in names if n.startswith("gpu-0-mig-")]
    assert "gpu-0-mig-7g40gb-0-0" in placements and "gpu-0-mig-1g5gb-19-6" in placements, placements
    counter_sets = [c["name"] for s in dynamic.slices for c in s.shared_counters]
    assert "gpu-0-counter-set" in counter_sets


@pytest.mark.parametrize("profile", [V134, V135], ids=["1.34-beside-devices", "1.35-counters-only-slice"])
async def test_dynamic_mig_layouts(h100, profile):
    pool = slices.desired_pools(h100, {}, DYNAMIC, profile)[slices.GPU_DRIVER]
    rendered = bodies(pool, profile)
    for body in rendered:
        (assert_valid_134 if profile is V134 else assert_valid)(body)
        assert body["spec"]["pool"]["resourceSliceCount"] == len(rendered)
    if profile is V134:
        assert len(rendered) == 8  # one slice per GPU: its counter set beside its devices
        for i, body in enumerate(rendered):
            [cs] = body["spec"]["sharedCounters"]
            assert cs["name"] == f"gpu-{i}-counter-set"
            assert {c["counterSet"] for d in body["spec"]["devices"] for c in d["consumesCounters"]} == {cs["name"]}
    else:
        assert len(rendered) == 9  # a counters-only slice, then one device slice per GPU
        head = rendered[0]["spec"]
        assert "devices" not in head and len(head["sharedCounters"]) == 8
        for body in rendered[1:]:
            assert "sharedCounters" not in body["spec"] and len(body["spec"]["devices"]) <= 64
    devices = {d["name"]: d for b in rendered for d in b["spec"].get("devices", [])}
    full, mig = devices["gpu-0"], devices["gpu-0-mig-1g10gb-19-3"]
    full_counters = full["consumesCounters"][0]["counters"]
    mig_counters = mig["consumesCounters"][0]["counters"]
    assert {f"memory-slice-{i}" for i in range(8)} <= set(full_counters)  # the full GPU takes every slice
    assert {k for k in mig_counters if k.startswith("memory-slice")} == {"memory-slice-3"}
    assert "uuid" not in mig["attributes"]  # no UUID until the MIG device exists
    cs = next(c for b in rendered for c in b["spec"].get("sharedCounters", []) if c["name"] == "gpu-0-counter-set")
    assert set(full_counters) == set(cs["counters"])


async def test_dynamic_mode_without_mig_capable_gpus_falls_back_with_a_warning(tmp_path):
    inv = await scan(tmp_path, "n1", simulate="l40sx2")
    pool = slices.desired_pools(inv, {}, DYNAMIC, V135)[slices.GPU_DRIVER]
    assert any("no GPU on the node is MIG-capable" in n for n in pool.notes)
    [body] = bodies(pool, V135)
    assert [d["name"] for d in body["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert "sharedCounters" not in body["spec"]


def _health(device: str, state: str = "Unhealthy", reason: str = "xid", xid: int = 79) -> DeviceHealth:
    return DeviceHealth(
        node="n1",
        device=device,
        state=state,  # type: ignore[arg-type]
        reason=reason,
        xid=xid,
        observed_at=1_790_000_000.7,
    )


async def test_unhealthy_devices_get_taints_and_healthy_ones_lose_them(h100):
    health = {
        "gpu-1": _health("gpu-1"),
        "gpu-2": _health("gpu-2", reason="gpu-lost", xid=0),
        "gpu-3": _health("gpu-3", state="Healthy", reason="recovered", xid=0),
    }
    pool = slices.desired_pools(h100, health, STATIC, V135)[slices.GPU_DRIVER]
    [body] = bodies(pool, V135)
    assert_valid(body)
    devices = {d["name"]: d for d in body["spec"]["devices"]}
    assert devices["gpu-1"]["taints"] == [
        {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule", "timeAdded": "2026-09-21T14:13:20Z"}
    ]
    assert devices["gpu-2"]["taints"][0]["key"] == "gpu.nvidia.com/gpu-lost"
    assert "taints" not in devices["gpu-0"] and "taints" not in devices["gpu-3"]
    no_exec = slices.desired_pools(h100, health, slices.SliceOptions(taint_effect="NoExecute"), V135)
    assert no_exec[slices.GPU_DRIVER].slices[0].devices[1]["taints"][0]["effect"] == "NoExecute"


async def test_a_sick_gpu_taints_its_dynamic_mig_placements(h100):
    pool = slices.desired_pools(h100, {"gpu-0": _health("gpu-0", xid=48)}, DYNAMIC, V134)[slices.GPU_DRIVER]
    tainted = {d["name"] for s in pool.slices for d in s.devices if d.get("taints")}
    assert "gpu-0" in tainted and "gpu-0-mig-1g10gb-19-0" in tainted
    assert not any(name.startswith("gpu-1") for name in tainted)


async def test_129_devices_split_into_two_slices_with_the_right_count(h100):
    big = widened(h100, 129)
    pool = slices.desired_pools(big, {}, STATIC, V134)[slices.GPU_DRIVER]
    rendered = bodies(pool, V134)
    assert [len(b["spec"]["devices"]) for b in rendered] == [128, 1]
    for body in rendered:
        assert_valid(body)
        assert body["spec"]["pool"]["resourceSliceCount"] == 2
    assert [b["metadata"]["name"] for b in rendered] == ["n1-gpu.nvidia.com-000", "n1-gpu.nvidia.com-001"]


async def test_taints_on_135_cap_a_slice_at_64_devices(h100):
    big = widened(h100, 100)
    health = {"gpu-5": _health("gpu-5")}
    on_135 = slices.desired_pools(big, health, STATIC, V135)[slices.GPU_DRIVER]
    assert [len(s.devices) for s in on_135.slices] == [64, 36]
    on_134 = slices.desired_pools(big, health, STATIC, V134)[slices.GPU_DRIVER]
    assert [len(s.devices) for s in on_134.slices] == [100]


async def test_more_than_eight_counter_sets_take_two_counter_slices_on_135(h100):
    big = widened(h100, 12)
    pool = slices.desired_pools(big, {}, DYNAMIC, V135)[slices.GPU_DRIVER]
    counter_slices = [s for s in pool.slices if s.shared_counters]
    assert [len(s.shared_counters) for s in counter_slices] == [8, 4]
    assert all(not s.devices for s in counter_slices)


async def test_v1beta1_form_wraps_devices_in_basic_and_validates(h100):
    pool = slices.desired_pools(h100, {"gpu-1": _health("gpu-1")}, STATIC, V133_BETA)[slices.GPU_DRIVER]
    [body] = bodies(pool, V133_BETA)
    assert body["apiVersion"] == "resource.k8s.io/v1beta1"
    first = body["spec"]["devices"][1]
    assert set(first) == {"name", "basic"} and first["basic"]["taints"][0]["value"] == "79"
    assert_valid(body, "v1beta1")


async def test_content_hash_ignores_generation_and_tracks_content(h100):
    pool = slices.desired_pools(h100, {}, STATIC, V134)[slices.GPU_DRIVER]
    again = slices.desired_pools(h100, {}, STATIC, V134)[slices.GPU_DRIVER]
    tainted = slices.desired_pools(h100, {"gpu-1": _health("gpu-1")}, STATIC, V134)[slices.GPU_DRIVER]
    [a], [b], [c] = objects.render(pool, "u"), objects.render(again, "u"), objects.render(tainted, "u")
    assert a.content_hash == b.content_hash != c.content_hash
    assert a.body(1, V134)["metadata"]["annotations"] == a.body(7, V134)["metadata"]["annotations"]
    [other_owner] = objects.render(pool, "another-uid")
    assert other_owner.content_hash != a.content_hash


def test_long_node_names_still_give_valid_unique_slice_names():
    long_a, long_b = "a" * 250, "a" * 249 + "b"
    names = {objects.slice_name(n, "gpu.nvidia.com", 0) for n in (long_a, long_b)}
    assert len(names) == 2 and all(len(n) <= 253 for n in names)


def test_a_counter_set_over_the_limit_is_refused_with_the_limit_named():
    fat = {"name": "gpu-0-counter-set", "counters": {f"c{i}": {"value": "1"} for i in range(33)}}
    with pytest.raises(split.SplitError, match="allows 32"):
        split.split_pool([], [fat], V134)
    with pytest.raises(split.SplitError, match="lacks"):
        split.split_pool([{"name": "x", "consumesCounters": [{"counterSet": "nope", "counters": {}}]}], [], V134)


def test_an_empty_pool_still_has_one_slice():
    assert split.split_pool([], [], V134) == [split.SliceContent()]
