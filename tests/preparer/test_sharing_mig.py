"""Time-slicing, MPS, static and dynamic MIG, and sharing by config: the preparer over its real socket,
discovery in-process on a simulated H100 node, device operations over a real nats-server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embedded.harness.discovery import RunningDiscovery
from services.preparer.host.devices import DeviceOps
from shared.bus import Bus
from shared.events.inventory import MigPlacement
from tests.preparer.helpers import MemoryClaims, claim_doc, gpu_config, running_node, spec_of, without_metadata


def gpu(disc: RunningDiscovery, name: str):
    return next(g for g in disc.inventory.gpus if g.name == name)


async def test_time_slicing_is_applied_and_reset(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    claim = claims.add(
        claim_doc(
            name="ts",
            results=[("gpu", "gpu-0")],
            configs=[gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})],
        )
    )
    async with running_node(claims, root, bus=bus) as node:
        result = (await node.plugin.prepare([claim]))[claim.uid]
        assert result.error == ""
        assert gpu(discovery, "gpu-0").sharing.timeslice == "Long"
        record = node.service.checkpoint.claims[claim.uid]
        assert record.configs[0]["sharing"]["strategy"] == "TimeSlicing"
        assert record.devices[0].sharing == "TimeSlicing"
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert gpu(discovery, "gpu-0").sharing.timeslice == "Default"


async def test_mps_daemon_started_mounted_and_stopped(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    claim = claims.add(
        claim_doc(
            name="mps",
            results=[("gpus", "gpu-1"), ("gpus", "gpu-2")],
            configs=[
                gpu_config(
                    {
                        "strategy": "MPS",
                        "mpsConfig": {
                            "defaultActiveThreadPercentage": 50,
                            "defaultPinnedDeviceMemoryLimit": "10Gi",
                            "defaultPerDevicePinnedMemoryLimit": {"0": "5Gi"},
                        },
                    }
                )
            ],
        )
    )
    async with running_node(claims, root, bus=bus) as node:
        result = (await node.plugin.prepare([claim]))[claim.uid]
        assert result.error == ""
        daemon = node.service.checkpoint.claims[claim.uid].mps_daemon_id
        assert daemon.startswith(claim.uid + "-")
        assert gpu(discovery, "gpu-1").sharing.mps_daemon == daemon == gpu(discovery, "gpu-2").sharing.mps_daemon
        for dev in spec_of(node.cdi_dir, claim.uid)["devices"]:
            edits = without_metadata(dev["containerEdits"])
            assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
            assert {m["containerPath"] for m in edits["mounts"]} == {"/tmp/nvidia-mps", "/dev/shm"}
            assert all(Path(m["hostPath"]).is_relative_to(discovery.config.mps_root) for m in edits["mounts"])
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert gpu(discovery, "gpu-1").sharing.mps_daemon == ""


async def test_static_mig_device_is_used_as_is(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    ops = DeviceOps("n1")
    ops.bus = bus
    parent = gpu(discovery, "gpu-3")
    made = await ops.mig_create(parent.uuid, "1g.10gb", MigPlacement(start=0, size=1))
    assert made.device is not None
    name = made.device.name
    assert name == "gpu-3-mig-1g10gb-19-0"
    claim = claims.add(claim_doc(name="mig", results=[("mig", name)]))
    async with running_node(claims, root, bus=bus) as node:
        result = (await node.plugin.prepare([claim]))[claim.uid]
        assert result.error == "", result.error
        [dev] = spec_of(node.cdi_dir, claim.uid)["devices"]
        paths = [n["path"] for n in dev["containerEdits"]["deviceNodes"]]
        assert paths[0] == "/dev/nvidia3"
        assert sorted(paths[1:]) == sorted(made.device.device_path_caps) and len(paths) == 3
        assert node.service.checkpoint.claims[claim.uid].devices[0].dynamic_mig is False
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert [m.name for m in gpu(discovery, "gpu-3").mig_devices] == [name]  # static: still there


async def test_dynamic_mig_is_created_on_prepare_and_destroyed_on_unprepare(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    name = "gpu-4-mig-3g40gb-9-4"
    assert gpu(discovery, "gpu-4").mig_devices == []
    claim = claims.add(claim_doc(name="dyn", results=[("mig", name)]))
    async with running_node(claims, root, bus=bus) as node:
        result = (await node.plugin.prepare([claim]))[claim.uid]
        assert result.error == "", result.error
        [live] = gpu(discovery, "gpu-4").mig_devices
        assert live.name == name
        record = node.service.checkpoint.claims[claim.uid]
        assert record.devices[0].dynamic_mig and record.devices[0].uuid == live.uuid
        [dev] = spec_of(node.cdi_dir, claim.uid)["devices"]
        assert len(dev["containerEdits"]["deviceNodes"]) == 3
        # a second claim for the same MIG device is refused while the first holds it
        other = claims.add(claim_doc(name="dyn2", results=[("mig", name)]))
        assert "already allocated to a different claim" in (await node.plugin.prepare([other]))[other.uid].error
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert gpu(discovery, "gpu-4").mig_devices == []


async def test_dynamic_mig_gate_off_refuses_the_claim_and_creates_nothing(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    name = "gpu-4-mig-3g40gb-9-4"
    claim = claims.add(claim_doc(name="dyn-off", results=[("mig", name)]))
    async with running_node(claims, root, bus=bus, feature_gates="DynamicMIG=false") as node:
        result = (await node.plugin.prepare([claim]))[claim.uid]
        assert result.error.endswith(": dynamic MIG devices are turned off here (feature gate DynamicMIG=false)")
        assert gpu(discovery, "gpu-4").mig_devices == []
        assert (
            claim.uid not in node.service.checkpoint.claims
            or node.service.checkpoint.claims[claim.uid].state != "PrepareCompleted"
        )


async def test_a_gpu_shared_by_config_goes_to_both_claims(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    share = gpu_config({"strategy": "TimeSlicing"})
    a = claims.add(claim_doc(name="a", results=[("gpu", "gpu-5")], configs=[share]))
    b = claims.add(claim_doc(name="b", results=[("gpu", "gpu-5")], configs=[share]))
    c = claims.add(claim_doc(name="c", results=[("gpu", "gpu-5")]))
    async with running_node(claims, root, bus=bus) as node:
        results = await node.plugin.prepare([a])
        results |= await node.plugin.prepare([b, c])
        assert results[a.uid].error == "" and results[b.uid].error == ""
        assert "already allocated to a different claim" in results[c.uid].error
        assert await node.plugin.unprepare([a]) == {a.uid: ""}
        assert gpu(discovery, "gpu-5").sharing.timeslice == "Default"  # interval Default both ways
        assert node.service.checkpoint.claims[b.uid].state == "PrepareCompleted"


async def test_a_claim_asking_another_interval_of_a_gpu_time_sliced_for_others_is_refused(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    """A GPU has one time-slice interval: a second claim sharing it by config with another interval would change
    it under the first claim's pods. Refused with nothing changed; the same interval joins."""

    def sliced(name: str, interval: str) -> Any:
        config = gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}})
        return claims.add(claim_doc(name=name, results=[("gpu", "gpu-6")], configs=[config]))

    short, long, also_short = sliced("short", "Short"), sliced("long", "Long"), sliced("also-short", "Short")
    async with running_node(claims, root, bus=bus) as node:
        assert (await node.plugin.prepare([short]))[short.uid].error == ""
        assert gpu(discovery, "gpu-6").sharing.timeslice == "Short"
        refused = (await node.plugin.prepare([long]))[long.uid].error
        assert "it is time-sliced at interval Short for other claims on this node" in refused, refused
        assert "this claim asks for Long" in refused
        assert gpu(discovery, "gpu-6").sharing.timeslice == "Short"
        assert set(node.service.checkpoint.claims) == {short.uid}
        assert (await node.plugin.prepare([also_short]))[also_short.uid].error == ""
        assert node.service.checkpoint.claims[also_short.uid].devices[0].time_slice_interval == "Short"
        assert await node.plugin.unprepare([short, also_short]) == {short.uid: "", also_short.uid: ""}
        assert gpu(discovery, "gpu-6").sharing.timeslice == "Default"


async def test_class_config_then_claim_config_and_parent_request_matching(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    claim = claims.add(
        claim_doc(
            name="prec",
            results=[("big/fast", "gpu-6"), ("other", "gpu-7")],
            configs=[
                gpu_config(
                    {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}},
                    source="FromClaim",
                    requests=["big"],
                ),
                gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}, source="FromClass"),
            ],
        )
    )
    async with running_node(claims, root, bus=bus) as node:
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        assert gpu(discovery, "gpu-6").sharing.timeslice == "Short"  # claim config for parent request "big"
        assert gpu(discovery, "gpu-7").sharing.timeslice == "Long"  # class config for everything else
        await node.plugin.unprepare([claim])
