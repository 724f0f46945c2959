"""GPU shares in the published slices: each NodeConfig mode's devices against an expected fixture of
upstream's documented shape (NVIDIA's `--consumable-shares` names and policies), v1beta1 withholding
them, the default config publishing exactly today's slices, and shares through the real publisher
and embedded API server."""

from __future__ import annotations

import logging
from fractions import Fraction
from pathlib import Path
from typing import Any

import msgspec
import pytest

import embedded.apiserver.testing as apiserver_testing
from embedded.harness.discovery import running_discovery
from embedded.harness.publisher import node_slices, running_publisher, until
from services.publisher import shares, slices
from shared import nodeconfig
from shared.kube import rest as kube
from shared.kube.client import kube_api_client
from shared.quantity import parse_quantity
from tests.publisher.inventories import STATIC_MIG_MACHINE, scan
from tests.publisher.test_slices import V133_BETA, V134, V135, assert_valid, assert_valid_134, bodies

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "node-config"
STATIC = slices.SliceOptions()


def _range(default: str, low: str, high: str, step: str) -> dict[str, Any]:
    return {"default": default, "validRange": {"min": low, "max": high, "step": step}}


# What an H100 80GB's gpu-N device carries per mode (NVIDIA: cmd/gpu-kubelet-plugin/consumable_shares.go)
EXPECTED_CAPACITY: dict[str, dict[str, Any]] = {
    "nvidia-consumable-shares-memory.yaml": {
        "memory": {"value": "80Gi", "requestPolicy": _range("80Gi", "1Mi", "80Gi", "1Mi")}
    },
    "nvidia-consumable-shares-unlimited.yaml": {
        "memory": {"value": "80Gi", "requestPolicy": _range("0", "0", "80Gi", "1Mi")}
    },
    "nvidia-consumable-shares-count.yaml": {
        "memory": {"value": "80Gi", "requestPolicy": _range("0", "0", "80Gi", "1Mi")},
        "shares": {"value": "4", "requestPolicy": _range("1", "1", "4", "1")},
    },
    "mps-shares.yaml": {
        "memory": {"value": "80Gi", "requestPolicy": _range("10Gi", "10Gi", "80Gi", "10Gi")},
        "compute": {"value": "100", "requestPolicy": _range("10", "10", "100", "10")},
    },
}
DEV = {"pool": "dev"}


def settings_for(example: str, inv, labels=DEV) -> dict[str, nodeconfig.GpuSetting]:
    return nodeconfig.resolve(nodeconfig.load(EXAMPLES / example), labels, inv.gpus)


def check_request_policies(device: dict[str, Any]) -> None:
    """The server's rules for a requestPolicy (KEP-5075): min <= default <= max <= value, both on a step; or the
    default among validValues, each at most the value."""
    for name, cap in device.get("capacity", {}).items():
        policy = cap.get("requestPolicy")
        if policy is None:
            continue
        assert device.get("allowMultipleAllocations") is True, name
        if "validValues" in policy:
            values = [parse_quantity(v) for v in policy["validValues"]]
            assert parse_quantity(policy["default"]) in values and max(values) <= parse_quantity(cap["value"]), name
            continue
        rng = policy["validRange"]
        low, high, step = (parse_quantity(rng[k]) for k in ("min", "max", "step"))
        default, value = parse_quantity(policy["default"]), parse_quantity(cap["value"])
        assert low <= default <= high <= value, (name, policy)
        assert Fraction(default - low) % step == 0 and Fraction(high - low) % step == 0, (name, policy)


@pytest.fixture
async def api(tmp_path):
    async with apiserver_testing.running_apiserver(tmp_path / "api") as server:
        client = await kube_api_client(str(server.kubeconfig_path))
        try:
            server.client_raw = client  # type: ignore[attr-defined]
            yield server
        finally:
            await client.close()


@pytest.fixture
async def h100(tmp_path):
    return await scan(tmp_path, "n1", simulate="h100x8")


@pytest.mark.parametrize("example", sorted(EXPECTED_CAPACITY))
async def test_each_sharing_mode_publishes_the_expected_capacities_and_validates(h100, example):
    pool = slices.desired_pools(h100, {}, STATIC, V134, settings_for(example, h100))[slices.GPU_DRIVER]
    [body] = bodies(pool, V134)
    assert_valid(body)
    assert_valid_134(body)
    for device in body["spec"]["devices"]:
        assert device["allowMultipleAllocations"] is True
        assert device["capacity"] == EXPECTED_CAPACITY[example], device["name"]
        check_request_policies(device)
        assert len(device["attributes"]) + len(device["capacity"]) <= 32


async def test_the_shares_example_shares_only_the_dev_pools_big_gpus_with_its_taint_effect(h100):
    from shared.events.health import DeviceHealth

    sick = {
        "gpu-1": DeviceHealth(
            node="n1",
            device="gpu-1",
            uuid=h100.gpus[1].uuid,
            state="Unhealthy",
            reason="xid",
            xid=79,
            observed_at=1.0e9,
        )
    }
    dev = slices.desired_pools(h100, sick, STATIC, V135, settings_for("shares.yaml", h100))[slices.GPU_DRIVER]
    [body] = bodies(dev, V135)
    assert_valid(body)
    d1 = body["spec"]["devices"][1]
    assert d1["capacity"]["memory"] == {"value": "80Gi", "requestPolicy": _range("80Gi", "4Gi", "80Gi", "4Gi")}
    assert d1["taints"][0]["effect"] == "NoExecute"  # the rule's healthTaintEffect over --taint-effect
    prod = slices.desired_pools(h100, {}, STATIC, V135, settings_for("shares.yaml", h100, {"pool": "prod"}))
    assert prod == slices.desired_pools(h100, {}, STATIC, V135)


async def test_unaligned_memory_rounds_down_to_a_whole_step_as_upstream_does(h100):
    odd = msgspec.structs.replace(h100, gpus=[msgspec.structs.replace(h100.gpus[0], memory_bytes=80 * 2**30 + 500)])
    pool = slices.gpu_pool(odd, {}, STATIC, V134, settings_for("nvidia-consumable-shares-unlimited.yaml", odd))
    [device] = pool.slices[0].devices
    assert device["capacity"]["memory"] == {"value": "80Gi", "requestPolicy": _range("0", "0", "80Gi", "1Mi")}


async def test_static_mig_devices_are_shared_too_and_validate(tmp_path):
    inv = await scan(tmp_path, "mig", machine=STATIC_MIG_MACHINE)
    pool = slices.desired_pools(inv, {}, STATIC, V134, settings_for("mps-shares.yaml", inv))[slices.GPU_DRIVER]
    [body] = bodies(pool, V134)
    assert_valid(body)
    assert_valid_134(body)
    devices = {d["name"]: d for d in body["spec"]["devices"]}
    migs = [d for d in devices.values() if d["attributes"]["type"] == {"string": "mig"}]
    # a 10 GiB step from a 10 GiB minimum needs 20 GiB for two shares: these MIG devices are all smaller, so none
    # is shared out and each stays whole (the 5Gi-step test below shares the 3g.20gb one)
    assert migs and all(parse_quantity(d["capacity"]["memory"]["value"]) < 20 * 2**30 for d in migs)
    assert not any(d.get("allowMultipleAllocations") or "requestPolicy" in d["capacity"]["memory"] for d in migs)
    nvidia = slices.desired_pools(inv, {}, STATIC, V134, settings_for("nvidia-consumable-shares-memory.yaml", inv))
    [body] = bodies(nvidia[slices.GPU_DRIVER], V134)
    assert_valid_134(body)
    assert all(d.get("allowMultipleAllocations") for d in body["spec"]["devices"])  # 1Mi steps: MIG devices too
    nvidia_migs = [d for d in body["spec"]["devices"] if d["attributes"]["type"] == {"string": "mig"}]
    assert nvidia_migs and all(any(k.startswith("memorySlice") for k in d["capacity"]) for d in nvidia_migs)
    for d in nvidia_migs:
        check_request_policies(d)


async def test_dynamic_mig_devices_take_shares_whose_counters_are_consumed_once(tmp_path):
    """Dynamic MIG with NVIDIA's memory mode: every partitionable device (the full GPU and each placement) is
    offered as shares and still consumes its counters; through the scheduler's allocator, two shares of one
    placement consume them once, and an overlapping placement waits until both are gone. With mpsShares each
    also offers `compute`."""
    from embedded.scheduler.allocator import AllocatedState, schedule
    from embedded.scheduler.explain import condition_message
    from shared.deviceclasses import device_classes
    from tests.scheduler.conftest import claim, exactly
    from tests.scheduler.test_capacity import NODE, gpu_slice, results

    inv = await scan(tmp_path, "n2", simulate="h100x8")
    dynamic = slices.SliceOptions(mig_mode="dynamic")
    pool = slices.gpu_pool(inv, {}, dynamic, V135, settings_for("nvidia-consumable-shares-memory.yaml", inv))
    devices = {d["name"]: d for s in pool.slices for d in s.devices}
    assert devices and all(d.get("allowMultipleAllocations") and "consumesCounters" in d for d in devices.values())
    for body in bodies(pool, V135):
        assert_valid(body)
    for body in bodies(
        slices.gpu_pool(inv, {}, dynamic, V134, settings_for("nvidia-consumable-shares-memory.yaml", inv)), V134
    ):
        assert_valid_134(body)
    for d in devices.values():
        check_request_policies(d)
    mps = slices.gpu_pool(inv, {}, dynamic, V135, settings_for("mps-shares.yaml", inv))
    mps_devices = {d["name"]: d for s in mps.slices for d in s.devices}
    shared = [d for d in mps_devices.values() if d.get("allowMultipleAllocations")]  # those that hold two 10Gi steps
    assert mps_devices["gpu-0-mig-3g40gb-9-4"] in shared and all("consumesCounters" in d for d in shared)
    assert all(d["capacity"]["compute"]["requestPolicy"] == _range("10", "10", "100", "10") for d in shared)

    counter_set = next(c for s in pool.slices for c in s.shared_counters if c["name"].startswith("gpu-0"))
    three, seven = devices["gpu-0-mig-3g40gb-9-4"], devices["gpu-0-mig-7g80gb-0-0"]  # slices 4-7, and all
    state, classes = AllocatedState(), device_classes()
    pool_slices = [gpu_slice(three, seven, sharedCounters=[counter_set])]

    def place(name: str, profile: str, memory: str) -> Any:
        request = exactly(
            "gpu",
            "mig.nvidia.com",
            f'device.attributes["gpu.nvidia.com"].profile == "{profile}"',
            capacity={"requests": {"memory": memory}},
        )
        c = claim(name, [request])
        out = schedule([c], classes, pool_slices, state, [NODE])
        if out.node is not None:
            c["status"] = {"allocation": out.allocations[f"default/{name}"]}
            state.add_claim(c)
        return c, out

    a, first = place("a", "3g.40gb", "10Gi")
    b, second = place("b", "3g.40gb", "20Gi")
    assert [results(o)[0]["device"] for o in (first, second)] == [three["name"]] * 2
    _, whole = place("c", "7g.80gb", "10Gi")
    assert whole.node is None and "counters used up" in condition_message(whole.reports)
    state.remove_claim(a)
    state.remove_claim(b)
    assert place("c", "7g.80gb", "10Gi")[1].node == NODE


async def test_v1beta1_offers_no_shares_and_counts_them_withheld(h100):
    settings = settings_for("mps-shares.yaml", h100)
    pool = slices.desired_pools(h100, {}, STATIC, V133_BETA, settings)[slices.GPU_DRIVER]
    assert pool.shares_withheld == 8
    assert pool.slices == slices.desired_pools(h100, {}, STATIC, V133_BETA)[slices.GPU_DRIVER].slices
    [body] = bodies(pool, V133_BETA)
    assert_valid(body, "v1beta1")
    assert not any("allowMultipleAllocations" in d["basic"] for d in body["spec"]["devices"])


@pytest.mark.parametrize("example", [None, "exclusive.yaml", "time-slicing.yaml"])
@pytest.mark.parametrize("profile", [V134, V135, V133_BETA], ids=["1.34", "1.35", "v1beta1"])
async def test_the_default_and_non_sharing_configs_publish_exactly_todays_slices(h100, example, profile):
    today = slices.desired_pools(h100, {}, STATIC, profile)
    settings = (
        nodeconfig.resolve(nodeconfig.DEFAULT, DEV, h100.gpus) if example is None else settings_for(example, h100)
    )
    assert slices.desired_pools(h100, {}, STATIC, profile, settings) == today
    assert bodies(slices.desired_pools(h100, {}, STATIC, profile, settings)[slices.GPU_DRIVER], profile) == bodies(
        today[slices.GPU_DRIVER], profile
    )


def test_a_setting_without_shares_leaves_the_device_alone() -> None:
    device = {"name": "gpu-0", "capacity": {"memory": {"value": "80Gi"}}}
    assert shares.offer_shares(device, nodeconfig.GpuSetting(gpu="gpu-0", sharing="timeSlicing")) is device


async def _node(client, name: str, labels: dict[str, str]) -> None:
    await kube.request(
        client,
        "POST",
        "/api/v1/nodes",
        body={"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}},
    )


async def test_the_publisher_offers_shares_on_the_embedded_api_server(bus, api, nats_server, tmp_path):
    client = api.client_raw
    await _node(client, "dev-1", {"pool": "dev"})
    await _node(client, "prod-1", {"pool": "prod"})
    config = str(EXAMPLES / "shares.yaml")
    async with running_publisher(nats_server.url, str(api.kubeconfig_path), node_config=config) as pub:
        async with (
            running_discovery(bus, node="dev-1", simulate="h100x8", root=tmp_path / "dev"),
            running_discovery(bus, node="prod-1", simulate="h100x8", root=tmp_path / "prod"),
        ):

            async def published() -> bool:
                return [len(await node_slices(client, n)) for n in ("dev-1", "prod-1")] == [1, 1]

            await until(pub, published)
            [dev] = await node_slices(client, "dev-1")
            [prod] = await node_slices(client, "prod-1")
    for device in dev["spec"]["devices"]:
        assert device["allowMultipleAllocations"] is True
        assert device["capacity"]["memory"]["requestPolicy"] == _range("80Gi", "4Gi", "80Gi", "4Gi")
    assert not any(
        "allowMultipleAllocations" in d or "requestPolicy" in d["capacity"]["memory"] for d in prod["spec"]["devices"]
    )


async def test_on_v1beta1_the_publisher_withholds_shares_and_says_so_once(bus, api, nats_server, tmp_path, caplog):
    client = api.client_raw
    await _node(client, "a", {})
    await _node(client, "b", {})
    config = str(EXAMPLES / "mps-shares.yaml")
    with caplog.at_level(logging.WARNING, logger="services.publisher.service"):
        async with running_publisher(
            nats_server.url, str(api.kubeconfig_path), node_config=config, api_version="v1beta1"
        ) as pub:
            async with (
                running_discovery(bus, node="a", simulate="h100x8", root=tmp_path / "a"),
                running_discovery(bus, node="b", simulate="h100x8", root=tmp_path / "b"),
            ):

                async def published() -> bool:
                    return [len(await node_slices(client, n, version="v1beta1")) for n in ("a", "b")] == [1, 1]

                await until(pub, published)
                [a] = await node_slices(client, "a", version="v1beta1")
    assert not any("allowMultipleAllocations" in d["basic"] for d in a["spec"]["devices"])
    said = [r for r in caplog.records if "GPU shares not offered" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


async def test_mig_mps_shares_with_a_5gi_step_offer_a_static_mig_device_two_shares_or_more(tmp_path):
    """mig+mps: with a 5Gi memory step the 3g.20gb static MIG device (about 19.6 GiB) holds min + one step
    and more, so it is offered as mpsShares; the 1g.5gb and 2g.10gb ones (under 10 GiB) stay exclusive."""
    inv = await scan(tmp_path, "mig", machine=STATIC_MIG_MACHINE)
    path = tmp_path / "mig-mps.yaml"
    text = (EXAMPLES / "mps-shares.yaml").read_text().replace("memoryStep: 10Gi", "memoryStep: 5Gi")
    assert "memoryStep: 5Gi" in text
    path.write_text(text)
    settings = nodeconfig.resolve(nodeconfig.load(path), DEV, inv.gpus)
    pool = slices.desired_pools(inv, {}, STATIC, V134, settings)[slices.GPU_DRIVER]
    [body] = bodies(pool, V134)
    assert_valid(body)
    assert_valid_134(body)
    migs = [d for d in body["spec"]["devices"] if d["attributes"]["type"] == {"string": "mig"}]
    shared = [d for d in migs if d.get("allowMultipleAllocations")]
    assert [d["attributes"]["profile"]["string"] for d in shared] == ["3g.20gb"]
    [device] = shared
    check_request_policies(device)
    memory = device["capacity"]["memory"]
    assert memory["value"] == "15Gi" and memory["requestPolicy"] == _range("5Gi", "5Gi", "15Gi", "5Gi")
    assert parse_quantity(memory["value"]) // parse_quantity("5Gi") >= 2  # two shares of the minimum fit
    assert device["capacity"]["compute"]["requestPolicy"] == _range("10", "10", "100", "10")


async def test_a_shared_mig_devices_other_capacities_are_consumed_by_no_share_so_its_shares_all_fit(tmp_path):
    """Upstream consumes a capacity without a requestPolicy whole on every allocation: a MIG device's
    `multiprocessors`, engines and `memorySlice<i>` would go to its first share and no second share would fit.
    Each share consumes 0 of them; they stay on the device for selectors. Through the scheduler's allocator:
    the 3g.20gb device (15Gi in 5Gi steps) takes three 5Gi shares, and the fourth is told memory ran out."""
    from embedded.scheduler.explain import condition_message
    from shared.deviceclasses import device_classes
    from tests.scheduler.conftest import claim, exactly
    from tests.scheduler.test_capacity import NODE, Cluster, gpu_slice, results

    inv = await scan(tmp_path, "mig", machine=STATIC_MIG_MACHINE)
    path = tmp_path / "mig-mps.yaml"
    path.write_text((EXAMPLES / "mps-shares.yaml").read_text().replace("memoryStep: 10Gi", "memoryStep: 5Gi"))
    settings = nodeconfig.resolve(nodeconfig.load(path), DEV, inv.gpus)
    pool = slices.desired_pools(inv, {}, STATIC, V134, settings)[slices.GPU_DRIVER]
    [body] = bodies(pool, V134)
    [device] = [d for d in body["spec"]["devices"] if d.get("allowMultipleAllocations") and "mig" in d["name"]]
    others = {k: v for k, v in device["capacity"].items() if k not in ("memory", "compute")}
    assert {"multiprocessors", "copyEngines"} <= others.keys() and any(k.startswith("memorySlice") for k in others)
    assert all(v["requestPolicy"] == {"default": "0", "validValues": ["0"]} for v in others.values())
    assert int(others["multiprocessors"]["value"]) > 0  # still there for a selector to read

    cl = Cluster(device_classes(), [gpu_slice(device)])  # the shared device alone: nothing else takes a share
    request = exactly("s", "mig.nvidia.com", capacity={"requests": {"memory": "5Gi"}})
    placed = [cl.place(claim("s", [request], namespace=f"tenant-{i}")) for i in range(4)]
    assert [o.node for o in placed] == [NODE, NODE, NODE, None]
    shared = [results(o)[0] for o in placed[:3]]
    assert {r["device"] for r in shared} == {device["name"]} and len({r["shareID"] for r in shared}) == 3
    assert all(r["consumedCapacity"]["memory"] == "5Gi" for r in shared)
    assert all(r["consumedCapacity"]["multiprocessors"] == "0" for r in shared)
    assert "memory" in condition_message(placed[3].reports)


@pytest.mark.parametrize("mig", ["none", "static", "dynamic"])
async def test_a_rules_mig_mode_decides_each_gpus_devices(tmp_path, mig):
    """One A100 with MIG on and four MIG devices, one with MIG off. `none`: full GPUs only, so the MIG-on GPU is
    not offered and a note says why; `static`: the MIG devices that exist, and the other GPU whole; `dynamic`:
    every placement of the MIG-on GPU, made on demand (an Ampere GPU with MIG off stays whole)."""
    inv = await scan(tmp_path, "mig", machine=STATIC_MIG_MACHINE)
    on, off = inv.gpus
    assert on.mig_enabled and len(on.mig_devices) == 4 and not off.mig_enabled
    cfg = nodeconfig.from_obj(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "NodeConfig",
            "metadata": {"name": "mig"},
            "spec": {"rules": [{"name": "every-gpu", "mig": mig}]},
        }
    )
    pool = slices.gpu_pool(inv, {}, STATIC, V135, nodeconfig.resolve(cfg, DEV, inv.gpus))
    names = sorted(d["name"] for s in pool.slices for d in s.devices)
    if mig == "none":
        assert names == [off.name]
        assert any(f"{on.name} has MIG mode on and its NodeConfig rule says mig: none" in n for n in pool.notes)
    elif mig == "static":
        assert names == sorted([m.name for m in on.mig_devices] + [off.name])
    else:  # the MIG-on Ampere GPU offers its placements (not itself: MIG would have to go off); the other stays whole
        devices = {d["name"]: d for s in pool.slices for d in s.devices}
        placements = [n for n in names if n.startswith(f"{on.name}-mig-")]
        assert len(placements) == sum(len(p.placements) for p in on.mig_profiles)
        assert all("consumesCounters" in devices[n] for n in placements)
        assert sorted(set(names) - set(placements)) == [off.name]


async def test_memory_sizes_offer_those_sizes_only_and_a_request_takes_the_next_size_up(tmp_path, h100):
    """`memorySizes` (validValues): an H100 offers 10, 20 and 40 GiB shares, a 3g.20gb MIG device (~19.6 GiB) the
    10 GiB one only, a 1g.5gb none (it stays whole). Through the scheduler's allocator a 15Gi request consumes
    20Gi, a request naming none 10Gi, and the sizes never add up past the GPU."""
    from embedded.scheduler.explain import condition_message
    from shared.deviceclasses import device_classes
    from tests.scheduler.conftest import claim, exactly
    from tests.scheduler.test_capacity import Cluster, gpu_slice, results

    pool = slices.desired_pools(h100, {}, STATIC, V134, settings_for("mps-sized-shares.yaml", h100))
    [body] = bodies(pool[slices.GPU_DRIVER], V134)
    assert_valid(body)
    assert_valid_134(body)
    gpu0 = next(d for d in body["spec"]["devices"] if d["name"] == "gpu-0")
    check_request_policies(gpu0)
    assert gpu0["capacity"]["memory"]["requestPolicy"] == {"default": "10Gi", "validValues": ["10Gi", "20Gi", "40Gi"]}

    inv = await scan(tmp_path, "mig", machine=STATIC_MIG_MACHINE)
    migs = slices.desired_pools(inv, {}, STATIC, V134, settings_for("mps-sized-shares.yaml", inv))
    policies = {
        d["attributes"]["profile"]["string"]: d["capacity"]["memory"].get("requestPolicy")
        for d in bodies(migs[slices.GPU_DRIVER], V134)[0]["spec"]["devices"]
        if d["attributes"]["type"] == {"string": "mig"}
    }
    assert policies["3g.20gb"] == {"default": "10Gi", "validValues": ["10Gi"]}
    assert policies["1g.5gb"] is None and policies["2g.10gb"] is None  # under 10Gi: no size fits

    cl = Cluster(device_classes(), [gpu_slice(gpu0)])

    def place(name: str, memory: str | None) -> Any:
        extra = {"capacity": {"requests": {"memory": memory}}} if memory else {}
        return cl.place(claim(name, [exactly("gpu", "gpu.nvidia.com", **extra)]))

    taken = [
        results(place(n, m))[0]["consumedCapacity"]["memory"] for n, m in (("a", "15Gi"), ("b", None), ("c", "40Gi"))
    ]
    assert taken == ["20Gi", "10Gi", "40Gi"]
    full = place("d", "25Gi")  # 70Gi taken of the GPU's 80Gi: the next size up, 40Gi, no longer fits
    assert full.node is None and "not enough capacity left" in condition_message(full.reports)
    assert place("e", "50Gi").node is None  # not a size: no device takes it
