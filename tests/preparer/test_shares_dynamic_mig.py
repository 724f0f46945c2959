"""Shares of a dynamic MIG device across claims (KEP-5075 consumable capacity on a partitionable device): the
preparer over its real socket, discovery in-process on simulated H100s, device operations over a real
nats-server. The device is made once, for its first share, and destroyed by the undo of its last; a share that
joins it later, or whose prepare races the undo of the share that made it, ends on the one live device."""

from __future__ import annotations

import asyncio
import functools
import signal
import uuid as uuidlib
from pathlib import Path
from typing import Any

from embedded.harness.discovery import RunningDiscovery
from embedded.kubelet.client import register
from shared.bus import Bus
from shared.events import catalog
from shared.events.claims import ClaimLifecycle
from shared.natsserver import EmbeddedNats
from tests.fakedriver import FakeDriver
from tests.polling import wait_gone
from tests.preparer.helpers import MemoryClaims, Node, checkpoint, claim_doc, running_node
from tests.preparer.test_crash import (
    HungMigCreates,
    crash_rig,
    prepare_until_created,
)
from tests.preparer.test_shares import PID_FILE, daemon_starts, edits_of, gpu_of, mps_dirs, share_doc

MIG = "gpu-4-mig-3g40gb-9-4"  # a placement of gpu-4, which has no MIG device until a claim makes one


def share_of(name: str, namespace: str, memory: str = "10Gi") -> dict[str, Any]:
    """A claim allocated a plain share (memory only: no MPS) of the dynamic MIG device."""
    doc = claim_doc(name=name, namespace=namespace, results=[("mig", MIG)])
    result = doc["status"]["allocation"]["devices"]["results"][0]
    result["shareID"] = str(uuidlib.uuid4())
    result["consumedCapacity"] = {"memory": memory, "multiprocessors": "0"}
    return doc


def live(disc: RunningDiscovery) -> list[tuple[str, str]]:
    """(name, UUID) of every MIG device gpu-4 has now."""
    gpu = next(g for g in disc.inventory.gpus if g.name == "gpu-4")
    return [(m.name, m.uuid) for m in gpu.mig_devices]


async def creates(bus: Bus) -> list[int]:
    """A counter of the MIG-create requests discovery gets from now on (a list holding one int)."""
    seen = [0]

    async def count(_msg: Any) -> None:
        seen[0] += 1

    await bus.nc.subscribe(catalog.DEVICE_MIG_CREATE.format(node="n1"), cb=count)
    return seen


class ClaimEvents:
    """The claims whose lifecycle event of one kind has come, from the bus."""

    def __init__(self) -> None:
        self.uids: set[str] = set()
        self.changed = asyncio.Event()

    async def note(self, event: ClaimLifecycle, _ctx: object) -> None:
        self.uids.add(event.claim_uid)
        self.changed.set()

    async def wait_for(self, uids: set[str], timeout: float = 20.0) -> None:
        async with asyncio.timeout(timeout):
            while not uids <= self.uids:
                self.changed.clear()
                await self.changed.wait()


async def claim_events(bus: Bus, kind: str) -> ClaimEvents:
    seen = ClaimEvents()
    await bus.subscribe(catalog.CLAIM, seen.note, namespace="default", node="n1", event=kind)
    return seen


async def note_subject(seen: list[str], msg: Any) -> None:
    """A request's operation (the subject's last token), in the order they came."""
    seen.append(msg.subject.rsplit(".", 1)[-1])


def held_uuid(node: Node, uid: str) -> str:
    record = node.service.checkpoint.claims[uid]
    [dev] = record.devices
    assert dev.dynamic_mig and dev.share_id, dev
    return dev.uuid


async def test_shares_make_the_device_once_and_the_last_shares_undo_destroys_it(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    made = await creates(bus)
    first = [claims.add(share_of(f"share-{i}", f"tenant-{i}")) for i in range(3)]
    async with running_node(claims, root, bus=bus) as node:
        prepared = await node.plugin.prepare(first)  # three at once: one create
        assert all(prepared[c.uid].error == "" for c in first), prepared
        [(name, mig_uuid)] = live(discovery)
        assert name == MIG and {held_uuid(node, c.uid) for c in first} == {mig_uuid}
        later = claims.add(share_of("share-3", "tenant-3"))  # joins the device that exists
        assert (await node.plugin.prepare([later]))[later.uid].error == ""
        assert held_uuid(node, later.uid) == mig_uuid
        await bus.nc.flush()
        assert made == [1]

        for n, claim in enumerate([*first, later]):  # the share that made it goes first
            assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
            assert live(discovery) == ([] if n == 3 else [(MIG, mig_uuid)]), n


async def test_a_share_prepared_while_the_last_other_share_is_unprepared_ends_on_the_live_device(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    """The undo of the device's last share and the prepare of a new one run at once, either way round: the new
    share holds the device that exists after both (kept, or made again), and its undo destroys it."""
    async with running_node(claims, root, bus=bus) as node:
        for n in range(6):
            old = claims.add(share_of(f"old-{n}", "tenant-a"))
            assert (await node.plugin.prepare([old]))[old.uid].error == ""
            new = claims.add(share_of(f"new-{n}", "tenant-b"))
            if n % 2:  # the new share's plan sees the device; the undo may destroy it before the apply
                prepared, undone = await asyncio.gather(node.plugin.prepare([new]), node.plugin.unprepare([old]))
            else:
                undone, prepared = await asyncio.gather(node.plugin.unprepare([old]), node.plugin.prepare([new]))
            assert prepared[new.uid].error == "" and undone == {old.uid: ""}, (prepared, undone)
            [(_, mig_uuid)] = live(discovery)
            assert held_uuid(node, new.uid) == mig_uuid, n
            assert await node.plugin.unprepare([new]) == {new.uid: ""}
            assert live(discovery) == [], n


async def test_a_whole_claim_or_an_mps_share_on_a_device_with_plain_shares_is_refused(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    share = claims.add(share_of("share", "tenant-a"))
    whole = claims.add(claim_doc(name="whole", namespace="tenant-b", results=[("mig", MIG)]))
    mps = claims.add(share_doc("mps", "tenant-c", device=MIG))  # consumes compute: served through MPS
    async with running_node(claims, root, bus=bus) as node:
        assert (await node.plugin.prepare([share]))[share.uid].error == ""
        before = live(discovery)
        got = await node.plugin.prepare([whole, mps])
        assert "it has shares prepared for other claims" in got[whole.uid].error
        assert "and this claim asks for MPS sharing" in got[mps.uid].error, got[mps.uid].error
        assert live(discovery) == before and set(node.service.checkpoint.claims) == {share.uid}
        assert await node.plugin.unprepare([share]) == {share.uid: ""}
        assert live(discovery) == []


async def test_mps_shares_of_a_dynamic_mig_device_meet_in_one_daemon_stopped_before_the_device_goes(
    claims: MemoryClaims, root: Path, bus: Bus, fake: FakeDriver, real_discovery: RunningDiscovery
) -> None:
    """mig+mps on a MIG device made on demand: the first share makes the device, then the one daemon on it
    (CUDA_VISIBLE_DEVICES its UUID, the parent in ExclusiveProcess); each share has its own limits; the last
    share's unprepare stops the daemon, then destroys the device. A second round makes a new device and a new
    daemon for it."""
    mig = "gpu-2-mig-3g40gb-9-0"
    for round_ in range(2):
        shares = [
            claims.add(share_doc(f"mps-{round_}-{i}", f"tenant-{i}", device=mig, memory=m, compute=c))
            for i, (m, c) in enumerate((("10Gi", "20"), ("20Gi", "30")))
        ]
        async with running_node(claims, root, bus=bus) as node:
            prepared = await node.plugin.prepare(shares)
            assert all(prepared[c.uid].error == "" for c in shares), prepared
            [made] = gpu_of(real_discovery, "gpu-2").mig_devices
            [start] = daemon_starts(fake)[-1:]
            assert start["env"]["CUDA_VISIBLE_DEVICES"] == made.uuid and len(mps_dirs(real_discovery)) == 1
            assert gpu_of(real_discovery, "gpu-2").sharing.compute_mode == "ExclusiveProcess"
            for c, mib, compute in zip(shares, ("10240M", "20480M"), ("20", "30"), strict=True):
                env, _ = edits_of(node.cdi_dir, c.uid)
                assert (env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == (
                    f"0={mib}",
                    compute,
                )
                [held] = node.service.checkpoint.claims[c.uid].devices
                assert held.dynamic_mig and held.uuid == made.uuid and held.sharing == "MPS"
            pid = int((Path(start["env"]["CUDA_MPS_PIPE_DIRECTORY"]) / PID_FILE).read_text())

            assert await node.plugin.unprepare(shares[:1]) == {shares[0].uid: ""}
            assert not wait_gone(pid, timeout=0.2) and gpu_of(real_discovery, "gpu-2").mig_devices == [made]
            asked: list[str] = []
            subs = [
                await bus.nc.subscribe(entry.format(node="n1"), cb=functools.partial(note_subject, asked))
                for entry in (catalog.DEVICE_MPS_STOP, catalog.DEVICE_MIG_DESTROY)
            ]
            assert await node.plugin.unprepare(shares[1:]) == {shares[1].uid: ""}
            await bus.nc.flush()
            for sub in subs:
                await sub.unsubscribe()
            assert asked == ["mps-stop", "mig-destroy"], "the daemon stops before its device goes"
            assert wait_gone(pid, timeout=2.0), "the last share's unprepare stopped the daemon"
            assert gpu_of(real_discovery, "gpu-2").mig_devices == [] and mps_dirs(real_discovery) == []
            assert gpu_of(real_discovery, "gpu-2").sharing.compute_mode == "Default"
    assert len(daemon_starts(fake)) == 2


async def inventory_known(plugin: Any, whole_gpu: Any) -> None:
    """Prepare a whole-GPU claim as the kubelet does (again while it fails fast), then unprepare it: the preparer
    has discovery's inventory from then on."""
    async with asyncio.timeout(20):
        while (await plugin.prepare([whole_gpu]))[whole_gpu.uid].error:
            await asyncio.sleep(0.2)
    assert await plugin.unprepare([whole_gpu]) == {whole_gpu.uid: ""}


async def test_kill_9_while_two_shares_wait_on_the_devices_create_then_restart_leaves_nothing_and_retries_make_it_once(
    root: Path, nats_server: EmbeddedNats
) -> None:
    """Two shares prepared at once by a real `gpu-dra preparer`: one makes the device (discovery creates it and never
    answers), the other waits for it with its record on disk. kill -9; the restarted process rolls both back, and
    the undo of the last destroys the device, once; the kubelet's retries make it once more for both."""
    async with crash_rig(root, nats_server.url, "dynamic-mig-crash", "h100x8") as rig:
        shares = [await rig.claims.add(share_of(f"share-{i}", "default")) for i in range(2)]
        started, rolled_back = (
            await claim_events(rig.bus, "prepare-started"),
            await claim_events(rig.bus, "rolled-back"),
        )
        hung = await HungMigCreates(rig.disc, rig.bus).start()
        proc = await rig.start()
        plugin = await register(rig.reg_socket)
        # Until the preparer has discovery's inventory, a share's prepare fails at once: had one share failed so and
        # the other reached the create, the kubelet's one call would wait on the second and never retry the first.
        await inventory_known(plugin, await rig.claims.add(claim_doc(name="whole-gpu", results=[("gpu", "gpu-0")])))
        prepare = await prepare_until_created(plugin, shares, hung.created)
        await started.wait_for({c.uid for c in shares})  # each record on disk: the second waits for the device
        assert {checkpoint(root)[c.uid]["state"] for c in shares} == {"PrepareStarted"}
        [(_, made)] = live(rig.disc)
        proc.send_signal(signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL
        prepare.cancel()
        await plugin.close()
        await hung.restore()
        made_again = await creates(rig.bus)

        proc = await rig.start()
        try:
            await rolled_back.wait_for({c.uid for c in shares})  # each after its undo and its checkpoint write
            assert checkpoint(root) == {} and live(rig.disc) == [], "both rolled back, the device destroyed"
            plugin = await register(rig.reg_socket)
            got = await plugin.prepare(shares)
            assert all(got[c.uid].error == "" for c in shares), got
            [(_, mig_uuid)] = live(rig.disc)
            assert mig_uuid != made and made_again == [1]
            assert {checkpoint(root)[c.uid]["devices"][0]["uuid"] for c in shares} == {mig_uuid}
            assert await plugin.unprepare(shares[:1]) == {shares[0].uid: ""}
            assert live(rig.disc) == [(MIG, mig_uuid)]
            assert await plugin.unprepare(shares[1:]) == {shares[1].uid: ""}
            assert live(rig.disc) == []
            await plugin.close()
        finally:
            await rig.stop(proc)
