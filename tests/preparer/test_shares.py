"""Shares of one GPU across claims (KEP-5075 consumable capacity): each claim's allocation result carries a
shareID and consumedCapacity. The preparer over its real sockets, discovery in-process on simulated H100s
running a fake driver root's binaries (tests/fakedriver.py) over a real nats-server: eight tenants hold
shares of one GPU through its one MPS daemon, each with its own client limits; the daemon stops after the
last share's unprepare; conflicting modes are refused with nothing changed; a kill -9 mid-prepare loses
no share and starts no second daemon."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import uuid as uuidlib
from pathlib import Path
from typing import Any

import msgspec
from kubernetes_asyncio.client import CoreV1Api
from prometheus_client import REGISTRY

from embedded.harness.discovery import RunningDiscovery
from embedded.kubelet.client import Claim, register
from examples.ledger.accounting import share_fraction
from services.preparer.nodesettings import NodeSettings
from shared import nodeconfig
from shared.bus import Bus
from shared.devicemodel import binary_si
from shared.events import catalog
from shared.events.claims import ClaimLifecycle
from shared.events.devices import MpsStartReply, MpsStartRequest, MpsStopRequest
from shared.natsserver import EmbeddedNats
from tests.fakedriver import FakeDriver
from tests.polling import wait_gone
from tests.preparer.helpers import (
    MemoryClaims,
    checkpoint,
    claim_doc,
    gpu_config,
    running_node,
    without_metadata,
)
from tests.preparer.test_crash_sharing import (
    kill_9,
    node_parts,
    restart_and_wait_rollback,
    rolled_back_future,
    start_ready_preparer,
    stop,
)

PID_FILE = "nvidia-cuda-mps-control.pid"
GIB = 1 << 30


def share_doc(
    name: str,
    namespace: str,
    device: str = "gpu-0",
    *,
    memory: str = "10Gi",
    compute: str = "10",
    configs: list[dict[str, Any]] | None = None,
    share: bool = True,
) -> dict[str, Any]:
    """A claim allocated a share of `device` (or, with share False, the whole device)."""
    doc = claim_doc(name=name, namespace=namespace, results=[("gpu", device)], configs=configs)
    if share:
        result = doc["status"]["allocation"]["devices"]["results"][0]
        result["shareID"] = str(uuidlib.uuid4())
        result["consumedCapacity"] = {"memory": memory, "compute": compute}
    return doc


def edits_of(cdi_dir: Path, uid: str) -> tuple[dict[str, str], dict[str, str]]:
    """The claim's one device's env (name -> value) and mounts (container path -> host path), less the device
    metadata file's (tests/preparer/test_device_metadata.py)."""
    entry = checkpoint(cdi_dir.parent)[uid]
    [dev] = json.loads((cdi_dir / entry["cdi_spec"]).read_text())["devices"]
    cdi_id = entry["devices"][0]["cdi_device_ids"][0]
    assert cdi_id.endswith(f"={dev['name']}"), (cdi_id, dev["name"])  # the id names the spec's device
    edits = without_metadata(dev["containerEdits"])
    env = dict(e.split("=", 1) for e in edits["env"])
    return env, {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}


def daemon_starts(fake: FakeDriver) -> list[dict[str, Any]]:
    return [c for c in fake.calls("nvidia-cuda-mps-control") if c["argv"] == ["-d"]]


def mps_dirs(real_discovery: RunningDiscovery) -> list[str]:
    root = Path(real_discovery.config.mps_root)
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def gpu_of(real_discovery: RunningDiscovery, name: str) -> Any:
    return next(g for g in real_discovery.inventory.gpus if g.name == name)


async def test_eight_tenants_share_one_gpu_through_one_mps_daemon_stopped_after_the_last(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    tenants = [claims.add(share_doc(f"share-{i}", f"tenant-{i}", compute=str(5 + i))) for i in range(8)]
    share_ids = {
        c.uid: claims.docs[(c.namespace, c.name)]["status"]["allocation"]["devices"]["results"][0]["shareID"]
        for c in tenants
    }
    async with running_node(claims, root, bus=bus) as node:
        prepared = await node.plugin.prepare(tenants)  # one kubelet call: the eight prepare concurrently
        for c in tenants:
            assert prepared[c.uid].error == "", prepared[c.uid].error
            [dev] = prepared[c.uid].devices
            assert dev.device == "gpu-0" and dev.share_id == share_ids[c.uid]

        [start] = daemon_starts(fake)  # exactly one MPS daemon for the GPU
        pipe = Path(start["env"]["CUDA_MPS_PIPE_DIRECTORY"])
        assert start["env"]["CUDA_VISIBLE_DEVICES"] == gpu_of(real_discovery, "gpu-0").uuid
        assert (
            mps_dirs(real_discovery) == [pipe.parent.name]
            and gpu_of(real_discovery, "gpu-0").sharing.mps_daemon == pipe.parent.name
        )
        pid = int((pipe / PID_FILE).read_text())
        specs = {c.uid: node.service.checkpoint.claims[c.uid].cdi_spec for c in tenants}
        assert node.cdi_files() == sorted(set(specs.values())) and len(set(specs.values())) == 8, "one per limits"
        for i, c in enumerate(tenants):
            env, mounts = edits_of(node.cdi_dir, c.uid)
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(5 + i)  # its own limit
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
            assert mounts == {"/tmp/nvidia-mps": str(pipe), "/dev/shm": str(pipe.parent / "shm")}
            record = node.service.checkpoint.claims[c.uid]
            [held] = record.devices
            assert (record.state, held.share_id, held.consumed_capacity, held.mps_daemon) == (
                "PrepareCompleted",
                share_ids[c.uid],
                {"memory": "10Gi", "compute": str(5 + i)},
                pipe.parent.name,
            )
            assert record.mps_daemon_id == ""  # no claim-scoped daemon

        assert await node.plugin.unprepare(tenants[:7]) == {c.uid: "" for c in tenants[:7]}
        assert list(node.service.checkpoint.claims) == [tenants[7].uid]
        assert not wait_gone(pid, timeout=0.2), "the daemon serves the last share"
        assert "quit\n" not in [c.get("stdin") for c in fake.calls("nvidia-cuda-mps-control")]
        assert mps_dirs(real_discovery) == [pipe.parent.name]
        assert node.cdi_files() == [specs[tenants[7].uid]]

        assert await node.plugin.unprepare(tenants[7:]) == {tenants[7].uid: ""}
        assert wait_gone(pid, timeout=2.0), "the last share's unprepare stopped the daemon"
        assert fake.calls("nvidia-cuda-mps-control")[-1]["stdin"] == "quit\n"
        assert mps_dirs(real_discovery) == [] and gpu_of(real_discovery, "gpu-0").sharing.mps_daemon == ""
        assert gpu_of(real_discovery, "gpu-0").sharing.compute_mode == "Default"
        assert node.service.checkpoint.claims == {} and node.cdi_files() == []


async def test_claim_events_and_metrics_carry_each_share(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    shares = [claims.add(share_doc(f"share-{i}", f"tenant-{i}", compute=str(10 * (i + 1)))) for i in range(2)]
    shares.append(claims.add(share_doc("share-2", "tenant-0", device="gpu-0", memory="20Gi")))
    whole = claims.add(share_doc("whole", "tenant-w", device="gpu-1", share=False))
    share_ids = {
        c.uid: claims.docs[(c.namespace, c.name)]["status"]["allocation"]["devices"]["results"][0]["shareID"]
        for c in shares
    }
    memory = binary_si(gpu_of(real_discovery, "gpu-0").memory_bytes)
    labels = {"node": "n1", "driver": "gpu.nvidia.com", "device": "gpu-0"}
    sent: list[ClaimLifecycle] = []

    async def got(msg: Any) -> None:  # as a consumer gets them, off the wire
        sent.append(msgspec.json.decode(msg.data, type=ClaimLifecycle))

    sub = await bus.nc.subscribe("dra.v1.claim.>", cb=got)

    async def events(kind: str) -> dict[str, ClaimLifecycle]:
        await node.service.events.drained()
        await bus.nc.flush()
        return {e.claim_uid: e for e in sent if e.event == kind}

    async with running_node(claims, root, bus=bus) as node:
        prepared = await node.plugin.prepare([*shares, whole])
        assert all(r.error == "" for r in prepared.values()), prepared
        prepared_events = await events("prepared")
        for i, c in enumerate(shares):
            [dev] = prepared_events[c.uid].devices
            compute = str(10 * (i + 1)) if i < 2 else "10"
            assert (dev.device, dev.share_id, dev.consumed_capacity, dev.capacity) == (
                "gpu-0",
                share_ids[c.uid],
                {"memory": "20Gi" if i == 2 else "10Gi", "compute": compute},
                {"memory": memory, "compute": "100"},
            )
        [dev] = prepared_events[whole.uid].devices
        assert (dev.device, dev.share_id, dev.consumed_capacity, dev.capacity) == ("gpu-1", "", {}, {})
        assert REGISTRY.get_sample_value("gpu_dra_prepared_shares", {**labels, "namespace": "tenant-0"}) == 2.0
        assert REGISTRY.get_sample_value("gpu_dra_prepared_shares", {**labels, "namespace": "tenant-1"}) == 1.0
        consumed = functools.partial(REGISTRY.get_sample_value, "gpu_dra_prepared_share_capacity")
        assert consumed({**labels, "namespace": "tenant-0", "capacity": "memory"}) == 30 * GIB  # 10Gi + 20Gi
        assert consumed({**labels, "namespace": "tenant-0", "capacity": "compute"}) == 20.0  # 10 + the default 10
        assert consumed({**labels, "namespace": "tenant-1", "capacity": "memory"}) == 10 * GIB
        assert consumed({**labels, "namespace": "tenant-1", "capacity": "compute"}) == 20.0
        assert (
            REGISTRY.get_sample_value("gpu_dra_prepared_shares", {**labels, "device": "gpu-1", "namespace": "tenant-w"})
            is None
        )

        assert await node.plugin.unprepare(shares[:2]) == {c.uid: "" for c in shares[:2]}
        assert REGISTRY.get_sample_value("gpu_dra_prepared_shares", {**labels, "namespace": "tenant-0"}) == 1.0
        assert REGISTRY.get_sample_value("gpu_dra_prepared_shares", {**labels, "namespace": "tenant-1"}) is None
        assert consumed({**labels, "namespace": "tenant-0", "capacity": "memory"}) == 20 * GIB
        assert consumed({**labels, "namespace": "tenant-1", "capacity": "memory"}) is None
        unprepared = await events("unprepared")
        assert {uid: e.devices[0].share_id for uid, e in unprepared.items()} == {
            c.uid: share_ids[c.uid] for c in shares[:2]
        }
        assert await node.plugin.unprepare([shares[2], whole]) == {shares[2].uid: "", whole.uid: ""}
    await sub.unsubscribe()


async def test_a_mode_conflicting_with_the_gpus_shares_is_refused_with_nothing_changed(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    shares = [claims.add(share_doc(f"share-{i}", f"tenant-{i}")) for i in range(2)]
    mps = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}
    conflicts = {
        "has shares prepared": claims.add(share_doc("whole", "t-whole", share=False)),
        "MPS daemon runs for other shares": claims.add(share_doc("mps-50", "t-mps", configs=[gpu_config(mps)])),
        "time-slicing and MPS do not mix": claims.add(
            share_doc(
                "ts",
                "t-ts",
                configs=[gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})],
            )
        ),
        "claim-scoped daemon": claims.add(share_doc("mps-claim", "t-mpsc", configs=[gpu_config(mps)], share=False)),
    }
    async with running_node(claims, root, bus=bus) as node:
        prepared = await node.plugin.prepare(shares)
        assert [prepared[c.uid].error for c in shares] == ["", ""]
        before = (
            dict(checkpoint(root)),
            node.cdi_files(),
            fake.calls(),
            mps_dirs(real_discovery),
            gpu_of(real_discovery, "gpu-0").sharing,
        )
        for message, claim in conflicts.items():
            error = (await node.plugin.prepare([claim]))[claim.uid].error
            assert message in error and "gpu-0" in error, error
            after = (
                dict(checkpoint(root)),
                node.cdi_files(),
                fake.calls(),
                mps_dirs(real_discovery),
                gpu_of(real_discovery, "gpu-0").sharing,
            )
            assert after == before, f"{message}: something changed"
        assert await node.plugin.unprepare(shares) == {c.uid: "" for c in shares}
        assert mps_dirs(real_discovery) == []
        # with the shares gone, the whole-GPU claim gets it
        whole = conflicts["has shares prepared"]
        assert (await node.plugin.prepare([whole]))[whole.uid].error == ""


async def test_one_more_share_of_a_running_daemon_asks_discovery_nothing_until_discovery_drops_it(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    """A share of a GPU whose daemon this preparer started, with a completed share using it and discovery's
    inventory naming it, needs no mps-start request and one checkpoint write (a whole GPU's count). When
    discovery no longer names the daemon (its restart found it gone), or after the last share stopped it,
    the next share asks discovery again, which starts it."""
    requests: list[Any] = []

    async def seen(msg: Any) -> None:  # a copy of each mps-start request discovery gets
        requests.append(msg)

    sub = await bus.nc.subscribe("dra.v1.device.n1.mps-start", cb=seen)

    async def asked() -> int:
        await bus.nc.flush()
        return len(requests)

    tenants = [claims.add(share_doc(f"share-{i}", f"tenant-{i}")) for i in range(4)]
    async with running_node(claims, root, bus=bus) as node:
        inventory = node.service.plugin.inventory  # type: ignore[attr-defined]
        assert (await node.plugin.prepare(tenants[:1]))[tenants[0].uid].error == ""
        assert await asked() == 1
        _, first_mounts = edits_of(node.cdi_dir, tenants[0].uid)
        daemon = node.service.checkpoint.claims[tenants[0].uid].devices[0].mps_daemon
        async with asyncio.timeout(5):
            while inventory.current.gpus[0].sharing.mps_daemon != daemon:
                await inventory.changed.wait()

        writes = node.service.checkpoint.writes
        assert (await node.plugin.prepare(tenants[1:2]))[tenants[1].uid].error == ""
        assert await asked() == 1, "no request for one more share"
        assert node.service.checkpoint.writes == writes + 1, "one write, as a whole GPU's prepare"
        env, mounts = edits_of(node.cdi_dir, tenants[1].uid)
        assert mounts == first_mounts and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
        [held] = node.service.checkpoint.claims[tenants[1].uid].devices
        assert held.mps_daemon == daemon and checkpoint(root)[tenants[1].uid]["state"] == "PrepareCompleted"

        # discovery stops knowing the daemon (as when its restart found it gone): the next share asks, and
        # discovery starts a daemon again
        assert (await real_discovery.service.ops.mps_stop(MpsStopRequest(daemon_id=daemon))).ok
        async with asyncio.timeout(5):
            while inventory.current.gpus[0].sharing.mps_daemon:
                await inventory.changed.wait()
        assert (await node.plugin.prepare(tenants[2:3]))[tenants[2].uid].error == ""
        assert await asked() == 2 and len(daemon_starts(fake)) == 2
        assert edits_of(node.cdi_dir, tenants[2].uid)[1] == first_mounts
        assert gpu_of(real_discovery, "gpu-0").sharing.mps_daemon == daemon

        # the last share's unprepare stops the daemon: the next share starts it again
        assert await node.plugin.unprepare(tenants[:3]) == {c.uid: "" for c in tenants[:3]}
        assert mps_dirs(real_discovery) == []
        assert (await node.plugin.prepare(tenants[3:]))[tenants[3].uid].error == ""
        assert await asked() == 3 and len(daemon_starts(fake)) == 3
        assert await node.plugin.unprepare(tenants[3:]) == {tenants[3].uid: ""}
        assert mps_dirs(real_discovery) == [] and node.service.checkpoint.claims == {}
    await sub.unsubscribe()


async def test_kill_9_during_the_fifth_shares_prepare_keeps_every_share_and_the_one_daemon(
    root: Path, nats_server: EmbeddedNats
) -> None:
    async with node_parts(root, nats_server) as (bus, api, claims, real_discovery, fake):
        core = CoreV1Api(claims.client)
        for i in range(8):
            await core.create_namespace({"metadata": {"name": f"tenant-{i}"}})  # type: ignore[arg-type]
        tenants: list[Claim] = [await claims.add(share_doc(f"share-{i}", f"tenant-{i}")) for i in range(8)]
        proc = await start_ready_preparer(root, api, nats_server)
        plugin = await register(root / "reg" / "gpu.nvidia.com-reg.sock")
        prepared = await plugin.prepare(tenants[:4], timeout=30)
        assert all(prepared[c.uid].error == "" for c in tenants[:4]), prepared
        [start] = daemon_starts(fake)
        pipe = Path(start["env"]["CUDA_MPS_PIPE_DIRECTORY"])
        pid = int((pipe / PID_FILE).read_text())
        # A preparer that started or confirmed the daemon itself prepares one more share without asking
        # discovery; a restarted one asks (confirms) first: restarted, the fifth share's prepare makes the request.
        await plugin.close()
        await stop(proc)
        proc = await start_ready_preparer(root, api, nats_server)
        plugin = await register(root / "reg" / "gpu.nvidia.com-reg.sock")

        # The fifth share's start request reaches discovery (which confirms the running daemon), then never
        # gets its answer: the kill lands with the share recorded as a user of the daemon.
        real_sub = next(s for s in real_discovery.service.bus._subs if s.subject == "dra.v1.device.n1.mps-start")
        await real_sub.unsubscribe()
        confirmed: asyncio.Future[MpsStartReply] = asyncio.get_running_loop().create_future()
        hang = asyncio.Event()

        async def confirm_then_hang(req: MpsStartRequest) -> MpsStartReply:
            reply = await real_discovery.service.ops.mps_start(req)
            confirmed.set_result(reply)
            await hang.wait()
            return reply

        hijack = await bus.serve(catalog.DEVICE_MPS_START, confirm_then_hang, node="n1")
        fifth = tenants[4]
        prepare = asyncio.create_task(plugin.prepare([fifth], timeout=30))
        async with asyncio.timeout(20):
            assert (await confirmed).ok
        record = checkpoint(root)[fifth.uid]
        assert record["state"] == "PrepareStarted" and record["devices"][0]["mps_daemon"] == pipe.parent.name
        await kill_9(proc, prepare, plugin)
        hang.set()
        await hijack.unsubscribe()
        await bus.serve(catalog.DEVICE_MPS_START, real_discovery.service.ops.mps_start, node="n1")

        rolled_back = await rolled_back_future(bus, fifth.uid, fifth.namespace)
        proc = await restart_and_wait_rollback(root, api, nats_server, rolled_back)
        plugin = await register(root / "reg" / "gpu.nvidia.com-reg.sock")
        try:
            assert not wait_gone(pid, timeout=0.2), "the rollback of the fifth share kept the daemon of the others"
            assert sorted(checkpoint(root)) == sorted(c.uid for c in tenants[:4])
            prepared = await plugin.prepare(tenants, timeout=30)  # the kubelet retries (and repeats the four)
            assert all(prepared[c.uid].error == "" for c in tenants), prepared
            entries = checkpoint(root)
            assert sorted(entries) == sorted(c.uid for c in tenants)
            assert {e["state"] for e in entries.values()} == {"PrepareCompleted"}
            assert daemon_starts(fake) == [start] and int((pipe / PID_FILE).read_text()) == pid, "one daemon"
            assert mps_dirs(real_discovery) == [pipe.parent.name]
            cdi_dir = root / "cdi"
            [spec] = {e["cdi_spec"] for e in entries.values()}  # the same limits: one spec they all use
            assert spec.startswith("k8s.gpu.nvidia.com-share_")
            assert [p.name for p in cdi_dir.iterdir() if not p.name.startswith(".")] == [spec], "no leaked spec"
            for c in tenants:
                env, _ = edits_of(cdi_dir, c.uid)
                assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
            assert await plugin.unprepare(tenants, timeout=30) == {c.uid: "" for c in tenants}
            assert wait_gone(pid, timeout=2.0)
            assert checkpoint(root) == {} and mps_dirs(real_discovery) == []
        finally:
            await plugin.close()
            await stop(proc)


async def test_plain_shares_without_compute_start_no_daemon_and_carry_no_mps_limits(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    """NodeConfig `shares` and NVIDIA's --consumable-shares publish no `compute`: their shares are plain (nothing
    enforced), however much memory they consume, 0 included (`memoryDefault: none`)."""
    consumed = [{"memory": "4Gi"}, {"memory": "0"}, {"memory": "0", "shares": "1"}]
    tenants = []
    for i, capacity in enumerate(consumed):
        doc = share_doc(f"plain-{i}", f"tenant-{i}")
        doc["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] = capacity
        tenants.append(claims.add(doc))
    async with running_node(claims, root, bus=bus) as node:
        prepared = await node.plugin.prepare(tenants)
        for c, capacity in zip(tenants, consumed, strict=True):
            assert prepared[c.uid].error == "", prepared[c.uid].error
            env, mounts = edits_of(node.cdi_dir, c.uid)
            assert not [k for k in env if k.startswith("CUDA_MPS_")] and "/tmp/nvidia-mps" not in mounts, env
            [held] = node.service.checkpoint.claims[c.uid].devices
            assert held.shared and held.share_id and held.consumed_capacity == capacity and held.mps_daemon == ""
        assert (
            daemon_starts(fake) == []
            and mps_dirs(real_discovery) == []
            and gpu_of(real_discovery, "gpu-0").sharing.mps_daemon == ""
        )
        assert await node.plugin.unprepare(tenants) == {c.uid: "" for c in tenants}
        assert node.service.checkpoint.claims == {} and node.cdi_files() == []


async def test_an_mps_config_on_a_share_that_consumes_no_memory_gets_no_client_memory_limit(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    """NVIDIA's bats gpu-mps.yaml under --consumable-shares=4: the share consumes `shares: 1, memory: 0`. It is
    served by the GPU's daemon with the config's settings; 0 memory reserved means no client memory limit
    (not a limit of 0, which no MPS client could run under)."""
    mps = {
        "strategy": "MPS",
        "mpsConfig": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"},
    }
    doc = share_doc("mps-share", "default", configs=[gpu_config(mps)])
    doc["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] = {"shares": "1", "memory": "0"}
    claim = claims.add(doc)
    async with running_node(claims, root, bus=bus) as node:
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        env, mounts = edits_of(node.cdi_dir, claim.uid)
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env, env
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps" and "/tmp/nvidia-mps" in mounts
        [start] = daemon_starts(fake)
        controls = [c["stdin"] for c in fake.calls("nvidia-cuda-mps-control") if not c["argv"]]
        uuid = gpu_of(real_discovery, "gpu-0").uuid
        assert {
            "set_default_active_thread_percentage 50\n",
            f"set_default_device_pinned_mem_limit {uuid} 10240M\n",
        } <= set(controls), controls
        [held] = node.service.checkpoint.claims[claim.uid].devices
        assert held.mps_daemon == Path(start["env"]["CUDA_MPS_PIPE_DIRECTORY"]).parent.name
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert mps_dirs(real_discovery) == []


async def test_two_shares_of_one_gpu_in_one_claim_reach_it_once_with_their_limits_added(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    """Two requests of one claim may each be allocated a share of the same GPU: the claim's containers reach
    it through one CDI device whose client limits are the two shares' sum, and both results name it."""
    doc = claim_doc(name="two-shares", namespace="tenant-a", results=[("small", "gpu-0"), ("large", "gpu-0")])
    results = doc["status"]["allocation"]["devices"]["results"]
    for result, (memory, compute) in zip(results, (("10Gi", "10"), ("20Gi", "30")), strict=True):
        result["shareID"] = str(uuidlib.uuid4())
        result["consumedCapacity"] = {"memory": memory, "compute": compute}
    claim = claims.add(doc)
    async with running_node(claims, root, bus=bus) as node:
        prepared = (await node.plugin.prepare([claim]))[claim.uid]
        assert prepared.error == "", prepared.error
        assert sorted((d.request_names[0], d.share_id) for d in prepared.devices) == sorted(
            (r["request"], r["shareID"]) for r in results
        )
        [[cdi_id]] = {tuple(d.cdi_device_ids) for d in prepared.devices}  # one CDI device for both
        assert cdi_id.startswith("k8s.gpu.nvidia.com/share=") and cdi_id.endswith("-gpu-0"), cdi_id
        env, _ = edits_of(node.cdi_dir, claim.uid)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=30720M"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
        assert len(daemon_starts(fake)) == 1
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert mps_dirs(real_discovery) == [] and node.cdi_files() == []


def ready_queries(fake: FakeDriver) -> int:
    """How many times discovery has asked a daemon it started whether it is ready (the last step of a start)."""
    return sum(
        c.get("stdin") == "get_default_active_thread_percentage\n" for c in fake.calls("nvidia-cuda-mps-control")
    )


async def revived_pid(fake: FakeDriver, pipe: Path, starts: int, timeout: float = 10.0) -> int:
    """The daemon's pid once discovery has started it for the `starts`-th time and found it ready (another
    process's effect: a bounded poll)."""
    async with asyncio.timeout(timeout):
        while ready_queries(fake) < starts:
            await asyncio.sleep(0.05)
    return int((pipe / PID_FILE).read_text())


async def test_a_daemon_killed_under_its_shares_is_started_again_in_the_same_dirs_and_given_up_when_it_loops(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    """The MPS daemon dies under two shares (SIGKILL): discovery notices at once (it watches the process)
    and starts it again with the same settings and dirs, so the shares' containers reach it where their
    CDI mounts point; one more share still needs no request. A daemon that keeps dying is given up: the
    GPU is published without it, and the next share's prepare asks discovery, which starts one."""
    tenants = [claims.add(share_doc(f"share-{i}", f"tenant-{i}")) for i in range(3)]
    async with running_node(claims, root, bus=bus) as node:
        inventory = node.service.plugin.inventory  # type: ignore[attr-defined]
        prepared = await node.plugin.prepare(tenants[:2])
        assert all(prepared[c.uid].error == "" for c in tenants[:2]), prepared
        [start] = daemon_starts(fake)
        pipe = Path(start["env"]["CUDA_MPS_PIPE_DIRECTORY"])
        pid = int((pipe / PID_FILE).read_text())
        os.kill(pid, signal.SIGKILL)
        revived = await revived_pid(fake, pipe, 2)
        assert revived != pid and len(daemon_starts(fake)) == 2
        assert daemon_starts(fake)[1]["env"] == start["env"], "the same GPU and dirs"
        assert gpu_of(real_discovery, "gpu-0").sharing.mps_daemon == pipe.parent.name
        assert (await node.plugin.prepare(tenants[2:]))[tenants[2].uid].error == ""
        assert len(daemon_starts(fake)) == 2, "one more share: no request, the daemon runs"

        for starts in (3, 4):  # it keeps dying: started again up to three times a minute
            os.kill(revived, signal.SIGKILL)
            revived = await revived_pid(fake, pipe, starts)
        os.kill(revived, signal.SIGKILL)  # the fourth death in a minute: given up
        async with asyncio.timeout(10):
            while inventory.current.gpus[0].sharing.mps_daemon:
                await inventory.changed.wait()
        assert len(daemon_starts(fake)) == 4 and mps_dirs(real_discovery) == []
        assert gpu_of(real_discovery, "gpu-0").sharing.compute_mode == "Default"

        assert await node.plugin.unprepare(tenants[2:]) == {tenants[2].uid: ""}
        assert (await node.plugin.prepare(tenants[2:]))[tenants[2].uid].error == ""
        assert len(daemon_starts(fake)) == 5, "the next share's prepare asked discovery, which started one"
        assert await node.plugin.unprepare(tenants) == {c.uid: "" for c in tenants}
        assert mps_dirs(real_discovery) == [] and node.service.checkpoint.claims == {}


async def test_a_counted_shares_event_carries_the_gpus_share_count_so_a_ledger_bills_one_nth(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    """NVIDIA's <count> mode (NodeConfig `maxShares: 4`): a share consumes `shares: 1` and no memory. The
    prepared event names the GPU's count as its `shares` capacity, so the ledger example bills 1/4 of the
    GPU for it (before: no count, and a share of unknown size is billed whole)."""
    config = nodeconfig.validate(
        nodeconfig.NodeConfig(
            spec=nodeconfig.NodeConfigSpec(rules=[nodeconfig.Rule(name="four", sharing="shares", maxShares=4)])
        )
    )
    doc = share_doc("counted", "tenant-a")
    doc["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] = {"shares": "1", "memory": "0"}
    claim = claims.add(doc)
    sent: list[ClaimLifecycle] = []

    async def got(msg: Any) -> None:
        sent.append(msgspec.json.decode(msg.data, type=ClaimLifecycle))

    sub = await bus.nc.subscribe("dra.v1.claim.>", cb=got)
    async with running_node(claims, root, bus=bus, settings=NodeSettings(config)) as node:
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        await node.service.events.drained()
        await bus.nc.flush()
        [event] = [e for e in sent if e.event == "prepared"]
        [dev] = event.devices
        assert dev.capacity["shares"] == "4" and dev.consumed_capacity == {"shares": "1", "memory": "0"}
        assert share_fraction(msgspec.to_builtins(dev)) == 0.25
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
    await sub.unsubscribe()
