"""The CDI specs shares use together (services/preparer/host/sharedspecs.py), through the preparer's real sockets,
discovery in-process on simulated H100s running the fake driver root's MPS binaries.

Shares with the same edits (one GPU, its daemon, the same limits) use one spec named by its content; it is
written by the first and removed after the last; the runtime resolves each claim's CDI id to its own limits;
the start's sweep keeps the specs claims use and removes the others; and a claim about to complete with a
spec keeps it from the unprepare of its last other user.
"""

from __future__ import annotations

import asyncio
import uuid as uuidlib
from pathlib import Path
from typing import Any

from embedded.harness.discovery import RunningDiscovery
from embedded.nodeagent.cdi_resolve import load_specs, resolve
from services.preparer.host.cdi import (
    GPU_CDI,
    CdiDevice,
    CdiKind,
    ContainerEdits,
    DeviceNode,
    Mount,
    build_spec,
    common_digest,
    spec_digest,
)
from shared.bus import Bus
from tests.fakedriver import FakeDriver
from tests.preparer.helpers import MemoryClaims, running_node
from tests.preparer.test_shares import share_doc

SHARE_SPEC = "k8s.gpu.nvidia.com-share_"


def runtime_env(cdi_dir: Path, cdi_ids: list[str]) -> dict[str, str]:
    """The env a container runtime gives a container with these CDI devices."""
    return dict(e.split("=", 1) for e in resolve(cdi_ids, load_specs([cdi_dir])).env)


async def test_shares_with_the_same_limits_use_one_spec_removed_after_its_last_user(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    small = [claims.add(share_doc(f"small-{i}", f"tenant-{i}", compute="10")) for i in range(3)]
    large = claims.add(share_doc("large", "tenant-9", memory="20Gi", compute="30"))
    async with running_node(claims, root, bus=bus) as node:
        prepared = await node.plugin.prepare([*small, large])  # concurrently: one write per limits
        assert all(p.error == "" for p in prepared.values()), prepared
        ids = {uid: p.devices[0].cdi_device_ids for uid, p in prepared.items()}
        assert len({tuple(ids[c.uid]) for c in small}) == 1 and ids[large.uid] != ids[small[0].uid]
        files = node.cdi_files()
        assert len(files) == 2 and all(f.startswith(SHARE_SPEC) for f in files), files
        for claim, limits in [(c, ("0=10240M", "10")) for c in small] + [(large, ("0=20480M", "30"))]:
            env = runtime_env(node.cdi_dir, ids[claim.uid])
            assert (env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == limits

        assert await node.plugin.unprepare(small[:2]) == {c.uid: "" for c in small[:2]}
        assert len(node.cdi_files()) == 2, "the third small share still uses its spec"
        runtime_env(node.cdi_dir, ids[small[2].uid])  # still resolves
        assert await node.plugin.unprepare([small[2]]) == {small[2].uid: ""}
        assert node.cdi_files() == [node.service.checkpoint.claims[large.uid].cdi_spec]
        assert await node.plugin.unprepare([large]) == {large.uid: ""}
        assert node.cdi_files() == []


async def test_the_start_sweep_keeps_the_specs_claims_use_and_a_spec_is_written_again_after_a_restart(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    first = claims.add(share_doc("first", "tenant-a"))
    async with running_node(claims, root, bus=bus) as node:
        assert (await node.plugin.prepare([first]))[first.uid].error == ""
        [used] = node.cdi_files()
        content = (node.cdi_dir / used).read_text()
    stray = node.cdi_dir / f"{SHARE_SPEC}{'0' * 20}.json"  # a crash after a spec's write, before its claim's record
    stray.write_text(content)
    (node.cdi_dir / f".{SHARE_SPEC}{'1' * 20}.json.77.tmp").write_text("{")  # a write a crash cut short
    second = claims.add(share_doc("second", "tenant-b"))
    async with running_node(claims, root, bus=bus) as node:
        assert sorted(p.name for p in node.cdi_dir.iterdir()) == [used], "swept: what no claim names"
        (node.cdi_dir / used).unlink()  # lost, say, by an operator's hand: the next user writes it again
        assert (await node.plugin.prepare([second]))[second.uid].error == ""
        assert node.cdi_files() == [used] and (node.cdi_dir / used).read_text() == content
        [cdi_id] = node.service.checkpoint.claims[first.uid].devices[0].cdi_device_ids
        assert runtime_env(node.cdi_dir, [cdi_id])["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
        assert await node.plugin.unprepare([first, second]) == {first.uid: "", second.uid: ""}
        assert node.cdi_files() == []


async def test_a_claim_completing_with_a_spec_keeps_it_from_the_unprepare_of_its_last_other_user(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    """A node with no boot id writes specs in a worker thread (fsync'd). After a restart the first user writes the
    spec again; while that prepare has written it but not yet completed, the last other user unprepares."""
    no_boot_id = {"boot_id_path": str(root / "no-boot-id")}
    holder, newcomer = claims.add(share_doc("holder", "tenant-a")), claims.add(share_doc("newcomer", "tenant-b"))
    async with running_node(claims, root, bus=bus, **no_boot_id) as node:
        assert (await node.plugin.prepare([holder]))[holder.uid].error == ""
        [spec] = node.cdi_files()
    async with running_node(claims, root, bus=bus, **no_boot_id) as node:
        cdi: Any = node.service.plugin.preparer.cdi
        assert cdi.durable
        written, resume = asyncio.Event(), asyncio.Event()
        write_shared = cdi.write_shared

        async def slow_to_resume(digest: str, body: dict[str, Any]) -> str:
            name = await write_shared(digest, body)
            written.set()
            await resume.wait()  # the prepare resumes late, as after a worker thread under load
            return name

        cdi.write_shared = slow_to_resume
        prepare = asyncio.create_task(node.plugin.prepare([newcomer]))
        await asyncio.wait_for(written.wait(), 10)
        assert await node.plugin.unprepare([holder]) == {holder.uid: ""}
        assert node.cdi_files() == [spec], "the newcomer uses it"
        resume.set()
        assert (await prepare)[newcomer.uid].error == ""
        env = runtime_env(node.cdi_dir, node.service.checkpoint.claims[newcomer.uid].devices[0].cdi_device_ids)
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
        assert await node.plugin.unprepare([newcomer]) == {newcomer.uid: ""}
        assert node.cdi_files() == []


async def test_with_device_metadata_a_share_gets_a_spec_of_its_own(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    """Its spec mounts the claim's own metadata files: no other claim can use it."""
    shares = [claims.add(share_doc(f"meta-{i}", f"tenant-{i}")) for i in range(2)]
    async with running_node(claims, root, bus=bus, feature_gates="DeviceMetadata=true") as node:
        prepared = await node.plugin.prepare(shares)
        assert all(p.error == "" for p in prepared.values()), prepared
        assert node.cdi_files() == sorted(f"k8s.gpu.nvidia.com-claim_{c.uid}.json" for c in shares)
        for c in shares:
            [cdi_id] = prepared[c.uid].devices[0].cdi_device_ids
            assert cdi_id == f"k8s.gpu.nvidia.com/claim={c.uid}-gpu-0"
            assert runtime_env(node.cdi_dir, [cdi_id])["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
        assert await node.plugin.unprepare(shares) == {c.uid: "" for c in shares}
        assert node.cdi_files() == []


def test_a_spec_name_stands_for_one_content() -> None:
    """The digest covers every edit: two limits, two names; the same edits, the same name."""
    kind = CdiKind(GPU_CDI.vendor, "share")
    nodes = [DeviceNode("/dev/nvidia0", "/dev/nvidia0")]
    empty = common_digest(ContainerEdits())

    def share(compute: int, pipe: str = "/run/mps/a") -> list[CdiDevice]:
        env = [f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute}"]
        return [CdiDevice("gpu-0", nodes, env, [Mount(pipe, "/tmp/nvidia-mps")])]

    ten = spec_digest(share(10), empty, kind)
    assert ten == spec_digest(share(10), common_digest(ContainerEdits()), kind)
    others = {
        spec_digest(share(20), empty, kind),
        spec_digest(share(10, "/run/mps/b"), empty, kind),  # another daemon's pipe
        spec_digest(share(10), common_digest(ContainerEdits(env=[f"X={uuidlib.uuid4()}"])), kind),
        spec_digest(share(10), empty, CdiKind("k8s.compute-domain.nvidia.com", "share")),
    }
    assert ten not in others and len(others) == 4
    spec = build_spec(ten, share(10), ContainerEdits(), kind)
    assert spec["kind"] == "k8s.gpu.nvidia.com/share" and spec["devices"][0]["name"] == f"{ten}-gpu-0"
