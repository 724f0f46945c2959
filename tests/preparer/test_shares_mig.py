"""Shares of a static MIG device across claims (mig+mps, KEP-5075 consumable capacity): the preparer over its
real sockets, discovery in-process on simulated H100s running a fake driver root's binaries over a real
nats-server. The shares of one MIG device meet in one MPS daemon for that MIG device (CUDA_VISIBLE_DEVICES
its MIG UUID, the parent GPU in ExclusiveProcess), each with its own client limits; the daemon stays until
the last share is unprepared; a whole-device claim on a MIG device with shares is refused with nothing
changed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from embedded.harness.discovery import RunningDiscovery
from services.preparer.host.devices import DeviceOps
from shared.bus import Bus
from shared.events.inventory import MigDevice
from tests.fakedriver import FakeDriver
from tests.polling import wait_gone
from tests.preparer.helpers import MemoryClaims, gpu_config, running_node, spec_of
from tests.preparer.test_shares import PID_FILE, daemon_starts, edits_of, gpu_of, mps_dirs, share_doc


async def static_mig(bus: Bus, real_discovery: RunningDiscovery, gpu: str, profile: str, nth: int = 0) -> MigDevice:
    """Create a MIG device as an admin would (it is static: no claim made it)."""
    ops = DeviceOps("n1")
    ops.bus = bus
    parent = gpu_of(real_discovery, gpu)
    prof = next(p for p in parent.mig_profiles if p.name == profile)
    made = await ops.mig_create(parent.uuid, profile, prof.placements[nth])
    assert made.device is not None
    return made.device


def quits(fake: FakeDriver) -> list[Any]:
    return [c for c in fake.calls("nvidia-cuda-mps-control") if c.get("stdin") == "quit\n"]


async def test_shares_of_one_mig_device_meet_in_one_mps_daemon_kept_until_the_last(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    mig = await static_mig(bus, real_discovery, "gpu-1", "3g.40gb")
    limits = [("5Gi", "20", "5120M"), ("10Gi", "30", "10240M"), ("15Gi", "40", "15360M")]
    shares = [
        claims.add(share_doc(f"mig-share-{i}", f"tenant-{i}", device=mig.name, memory=m, compute=c))
        for i, (m, c, _) in enumerate(limits)
    ]
    async with running_node(claims, root, bus=bus) as node:
        prepared = await node.plugin.prepare(shares)  # concurrently: still one daemon
        for c in shares:
            assert prepared[c.uid].error == "", prepared[c.uid].error
            assert [d.device for d in prepared[c.uid].devices] == [mig.name]

        [start] = daemon_starts(fake)
        assert start["env"]["CUDA_VISIBLE_DEVICES"] == mig.uuid  # the daemon serves the MIG device
        pipe = Path(start["env"]["CUDA_MPS_PIPE_DIRECTORY"])
        daemon = pipe.parent.name
        assert mps_dirs(real_discovery) == [daemon]
        assert gpu_of(real_discovery, "gpu-1").sharing.compute_mode == "ExclusiveProcess"  # the parent's mode
        pid = int((pipe / PID_FILE).read_text())
        for c, (_, compute, mib) in zip(shares, limits, strict=True):
            env, mounts = edits_of(node.cdi_dir, c.uid)
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={mib}"  # its own limit, on its MIG device
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == compute
            assert mounts == {"/tmp/nvidia-mps": str(pipe), "/dev/shm": str(pipe.parent / "shm")}
            [dev] = spec_of(node.cdi_dir, c.uid)["devices"]
            paths = [n["path"] for n in dev["containerEdits"]["deviceNodes"]]
            assert sorted(paths[1:]) == sorted(mig.device_path_caps)  # the MIG device's caps
            [held] = node.service.checkpoint.claims[c.uid].devices
            assert (held.kind, held.uuid, held.sharing, held.mps_daemon) == ("mig", mig.uuid, "MPS", daemon)

        # a whole-device claim on the shared MIG device: refused before any side effect
        starts, calls = len(daemon_starts(fake)), len(fake.calls("nvidia-cuda-mps-control"))
        whole = claims.add(share_doc("whole", "tenant-w", device=mig.name, share=False))
        error = (await node.plugin.prepare([whole]))[whole.uid].error
        assert "has shares prepared for other claims" in error, error
        assert whole.uid not in node.service.checkpoint.claims
        assert f"k8s.gpu.nvidia.com-claim_{whole.uid}.json" not in node.cdi_files()
        assert (len(daemon_starts(fake)), len(fake.calls("nvidia-cuda-mps-control"))) == (starts, calls)

        assert await node.plugin.unprepare(shares[1:]) == {c.uid: "" for c in shares[1:]}
        assert not wait_gone(pid, timeout=0.2), "the daemon serves the last share"
        assert quits(fake) == [] and mps_dirs(real_discovery) == [daemon]
        assert gpu_of(real_discovery, "gpu-1").sharing.compute_mode == "ExclusiveProcess"

        assert await node.plugin.unprepare(shares[:1]) == {shares[0].uid: ""}
        assert wait_gone(pid, timeout=2.0), "the last share's unprepare stopped the daemon"
        assert len(quits(fake)) == 1 and mps_dirs(real_discovery) == []
        assert gpu_of(real_discovery, "gpu-1").sharing.compute_mode == "Default"
        assert [m.name for m in gpu_of(real_discovery, "gpu-1").mig_devices] == [mig.name]  # static: still there
        assert node.service.checkpoint.claims == {} and node.cdi_files() == []

        # the whole-device claim goes through now that the shares are gone
        assert (await node.plugin.prepare([whole]))[whole.uid].error == ""
        assert await node.plugin.unprepare([whole]) == {whole.uid: ""}


async def test_two_mig_devices_of_one_gpu_have_a_daemon_each_and_share_the_parent_mode(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    a = await static_mig(bus, real_discovery, "gpu-2", "3g.40gb", 0)
    b = await static_mig(bus, real_discovery, "gpu-2", "3g.40gb", 1)
    on_a = claims.add(share_doc("on-a", "tenant-a", device=a.name, memory="5Gi", compute="50"))
    on_b = claims.add(share_doc("on-b", "tenant-b", device=b.name, memory="20Gi", compute="25"))
    async with running_node(claims, root, bus=bus) as node:
        prepared = await node.plugin.prepare([on_a, on_b])
        assert prepared[on_a.uid].error == "" and prepared[on_b.uid].error == ""
        starts = daemon_starts(fake)
        assert sorted(s["env"]["CUDA_VISIBLE_DEVICES"] for s in starts) == sorted([a.uuid, b.uuid])
        assert edits_of(node.cdi_dir, on_a.uid)[0]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=5120M"
        assert edits_of(node.cdi_dir, on_b.uid)[0]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
        assert edits_of(node.cdi_dir, on_a.uid)[1] != edits_of(node.cdi_dir, on_b.uid)[1]  # own pipe dirs
        assert await node.plugin.unprepare([on_a]) == {on_a.uid: ""}
        # the other MIG device's daemon still needs the parent in ExclusiveProcess
        assert gpu_of(real_discovery, "gpu-2").sharing.compute_mode == "ExclusiveProcess"
        assert len(mps_dirs(real_discovery)) == 1
        assert await node.plugin.unprepare([on_b]) == {on_b.uid: ""}
        assert gpu_of(real_discovery, "gpu-2").sharing.compute_mode == "Default" and mps_dirs(real_discovery) == []


async def test_a_mig_device_config_with_mps_sets_its_shares_daemon_and_whole_devices_stay_refused(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    mig = await static_mig(bus, real_discovery, "gpu-3", "3g.40gb")
    mps = gpu_config({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 60}}, kind="MigDeviceConfig")
    shares = [
        claims.add(share_doc(f"cfg-{i}", "tenant", device=mig.name, memory="5Gi", compute="10", configs=[mps]))
        for i in range(2)
    ]
    whole = claims.add(share_doc("whole-mps", "tenant", device=mig.name, configs=[mps], share=False))
    async with running_node(claims, root, bus=bus) as node:
        prepared = await node.plugin.prepare(shares)
        assert all(prepared[c.uid].error == "" for c in shares), prepared
        [start] = daemon_starts(fake)
        assert start["env"]["CUDA_VISIBLE_DEVICES"] == mig.uuid
        settings = [c["stdin"] for c in fake.calls("nvidia-cuda-mps-control") if c.get("stdin")]
        assert "set_default_active_thread_percentage 60\n" in settings
        assert {edits_of(node.cdi_dir, c.uid)[0]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for c in shares} == {"10"}
        # a claim-scoped MPS daemon on a whole MIG device is still not served
        error = (await node.plugin.prepare([whole]))[whole.uid].error
        assert "served to shares only" in error, error
        assert whole.uid not in node.service.checkpoint.claims and len(daemon_starts(fake)) == 1
        assert await node.plugin.unprepare(shares) == {c.uid: "" for c in shares}
        assert mps_dirs(real_discovery) == [] and gpu_of(real_discovery, "gpu-3").sharing.compute_mode == "Default"


async def test_one_more_share_of_a_mig_devices_running_daemon_asks_discovery_nothing(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    """Discovery publishes a MIG device's daemon on the MIG device (not on its GPU): once it names it, one more
    share of the MIG device is prepared without an mps-start request, as on a full GPU."""
    mig = await static_mig(bus, real_discovery, "gpu-1", "3g.40gb")
    requests: list[Any] = []

    async def seen(msg: Any) -> None:  # a copy of each mps-start request discovery gets
        requests.append(msg)

    sub = await bus.nc.subscribe("dra.v1.device.n1.mps-start", cb=seen)
    shares = [
        claims.add(share_doc(f"mig-share-{i}", f"tenant-{i}", device=mig.name, memory="5Gi", compute="20"))
        for i in range(2)
    ]
    async with running_node(claims, root, bus=bus) as node:
        inventory = node.service.plugin.inventory  # type: ignore[attr-defined]
        assert (await node.plugin.prepare(shares[:1]))[shares[0].uid].error == ""
        daemon = node.service.checkpoint.claims[shares[0].uid].devices[0].mps_daemon

        def published() -> str:
            gpu = next(g for g in inventory.current.gpus if g.name == "gpu-1")
            assert gpu.sharing.mps_daemon == "", "a MIG device's daemon is not its GPU's"
            return next(m.mps_daemon for m in gpu.mig_devices if m.uuid == mig.uuid)

        async with asyncio.timeout(5):
            while published() != daemon:
                await inventory.changed.wait()
        await bus.nc.flush()
        assert len(requests) == 1
        assert (await node.plugin.prepare(shares[1:]))[shares[1].uid].error == ""
        await bus.nc.flush()
        assert len(requests) == 1, "no request for one more share of the MIG device"
        assert len(daemon_starts(fake)) == 1
        assert await node.plugin.unprepare(shares) == {c.uid: "" for c in shares}
        assert mps_dirs(real_discovery) == []
    await sub.unsubscribe()
