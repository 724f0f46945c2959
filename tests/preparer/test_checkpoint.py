"""The checkpoint file: crash-safe writes, forward tolerance, boot-id wipe, corrupt-file quarantine."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from services.preparer.host.checkpoint import (
    SCHEMA_VERSION,
    Checkpoint,
    CheckpointError,
    ClaimRecord,
    PreparedDevice,
)
from shared.files import fsync_count
from tests.preparer.helpers import MemoryClaims, claim_doc, running_node


def record(state: str = "PrepareCompleted") -> ClaimRecord:
    return ClaimRecord(
        state=state,  # type: ignore[arg-type]
        name="c",
        namespace="ns",
        devices=[PreparedDevice(requests=["gpu"], pool="n1", device="gpu-0")],
    )


async def test_round_trip_and_no_temp_files_left(root: Path) -> None:
    path = root / "cp" / "checkpoint.json"
    cp = Checkpoint(path, boot_id="boot-1")
    await cp.load()
    await cp.put("uid-1", record())
    assert sorted(p.name for p in path.parent.iterdir()) == [
        ".checkpoint.json.slot-a",
        ".checkpoint.json.slot-b",
        "checkpoint.boot",
        "checkpoint.json",
    ]
    again = Checkpoint(path, boot_id="boot-1")
    await again.load()
    assert again.claims == {"uid-1": record()}
    doc = json.loads(path.read_text())
    assert doc["nodeBootID"] == "boot-1" and doc["schemaVersion"] == SCHEMA_VERSION
    assert "checksum" not in json.dumps(doc)


async def test_unknown_fields_from_a_newer_version_are_kept(root: Path) -> None:
    path = root / "checkpoint.json"
    cp = Checkpoint(path, boot_id="b")
    await cp.load()
    await cp.put("uid-1", record())
    doc = json.loads(path.read_text())
    doc["schemaVersion"] = SCHEMA_VERSION + 1
    doc["futureTop"] = {"x": 1}
    doc["preparedClaims"]["uid-1"]["futureClaimField"] = [1, 2]
    doc["preparedClaims"]["uid-1"]["devices"][0]["futureDeviceField"] = True  # below our level: dropped is fine
    path.write_text(json.dumps(doc))
    newer = Checkpoint(path, boot_id="b")
    await newer.load()
    assert newer.quarantined is None
    assert newer.claims["uid-1"].state == "PrepareCompleted"
    await newer.put("uid-2", record("PrepareStarted"))
    rewritten = json.loads(path.read_text())
    assert rewritten["futureTop"] == {"x": 1}
    assert rewritten["schemaVersion"] == SCHEMA_VERSION + 1
    assert rewritten["preparedClaims"]["uid-1"]["futureClaimField"] == [1, 2]
    assert set(rewritten["preparedClaims"]) == {"uid-1", "uid-2"}


async def test_a_reboot_wipes_prepared_state(root: Path) -> None:
    path = root / "checkpoint.json"
    cp = Checkpoint(path, boot_id="before")
    await cp.load()
    await cp.put("uid-1", record())
    after = Checkpoint(path, boot_id="after")
    await after.load()
    assert after.claims == {} and after.wiped_for_reboot == 1
    assert json.loads(path.read_text())["nodeBootID"] == "after"


async def test_a_legacy_file_without_boot_id_is_kept_and_stamped(root: Path) -> None:
    path = root / "checkpoint.json"
    path.write_text(
        json.dumps({"preparedClaims": {"u": {"state": "PrepareCompleted", "name": "c", "namespace": "ns"}}})
    )
    cp = Checkpoint(path, boot_id="now")
    await cp.load()
    assert set(cp.claims) == {"u"}
    assert json.loads(path.read_text())["nodeBootID"] == "now"


async def test_a_corrupt_file_is_quarantined_and_start_continues(root: Path) -> None:
    for garbage in (b'{"preparedClaims": {"u": {"state": "Halfway"}}}', b"\x00\x01not json", b"[1, 2]"):
        path = root / "checkpoint.json"
        path.write_bytes(garbage)
        cp = Checkpoint(path, boot_id="b")
        await cp.load()
        assert cp.claims == {}
        assert cp.quarantined is not None and cp.quarantined.read_bytes() == garbage
        assert cp.corrupt_reason
        assert json.loads(path.read_text())["preparedClaims"] == {}
        cp.quarantined.unlink()


async def test_reboot_through_the_service_wipes_and_the_device_is_free(claims: MemoryClaims, root: Path) -> None:
    (root / "host" / "dev").mkdir(parents=True)
    (root / "host" / "dev" / "nvidia0").touch()
    claim = claims.add(claim_doc(name="pre-reboot", results=[("gpu", "gpu-0")]))
    async with running_node(claims, root, dev_root=str(root / "host")) as node:
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
    (root / "boot_id").write_text("a-new-boot\n")
    os.sync()
    other = claims.add(claim_doc(name="post-reboot", results=[("gpu", "gpu-0")]))
    async with running_node(claims, root, dev_root=str(root / "host")) as node:
        assert node.service.checkpoint.claims == {}
        assert (await node.plugin.prepare([other]))[other.uid].error == ""


async def test_a_corrupt_checkpoint_is_reported(claims: MemoryClaims, root: Path) -> None:
    from services.preparer.host.service import PreparerService
    from tests.preparer.helpers import node_config

    cfg = node_config(root)
    cp_path = Path(cfg.plugins_dir) / "gpu.nvidia.com" / "checkpoint.json"
    cp_path.parent.mkdir(parents=True)
    cp_path.write_text("{broken")
    reports: list[tuple[str, Path]] = []

    async def report(reason: str, moved: Path) -> None:
        reports.append((reason, moved))

    async with PreparerService(cfg, claims, report_corrupt=report):
        pass
    [(reason, moved)] = reports
    assert moved.read_text() == "{broken" and reason


async def test_changes_made_together_share_one_write(root: Path) -> None:
    path = root / "checkpoint.json"
    cp = Checkpoint(path, boot_id="b")
    await cp.load()
    before = cp.writes
    await asyncio.gather(*(cp.put(f"uid-{i}", record()) for i in range(8)))
    assert cp.writes - before == 1
    assert set(json.loads(path.read_text())["preparedClaims"]) == {f"uid-{i}" for i in range(8)}
    # a change made while a write is on its way goes out in the next one, not lost and not alone per claim
    await asyncio.gather(cp.remove("uid-0"), cp.remove("uid-1"), cp.put("uid-9", record()))
    assert cp.writes - before == 2
    assert set(json.loads(path.read_text())["preparedClaims"]) == {f"uid-{i}" for i in (2, 3, 4, 5, 6, 7, 9)}


async def test_a_failed_group_write_fails_every_change_it_carried(root: Path) -> None:
    path = root / "cp" / "checkpoint.json"
    cp = Checkpoint(path, boot_id="b")
    await cp.load()
    await cp.put("kept", record())
    shutil.rmtree(path.parent)  # the next write cannot create its temp file
    results = await asyncio.gather(cp.put("new", record()), cp.remove("kept"), return_exceptions=True)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert set(cp.claims) == {"kept"}  # each caller restored its own record
    path.parent.mkdir()
    await cp.put("after", record())  # the committer is not stuck
    assert set(json.loads(path.read_text())["preparedClaims"]) == {"kept", "after"}


async def test_with_a_boot_id_only_the_boot_marker_is_synced_without_one_every_write(root: Path) -> None:
    """With a boot id the first load of a boot writes the marker (file and directory fsync'd) and no write
    after it syncs; a load under the same boot writes no marker; without a boot id each write syncs twice."""
    path = root / "checkpoint.json"
    before = fsync_count()
    cp = Checkpoint(path, boot_id="b")
    await cp.load()
    assert fsync_count() - before == 2 and (root / "checkpoint.boot").read_text() == "b\n"
    before = fsync_count()
    await cp.put("uid-1", record())
    await cp.remove("uid-1")
    same_boot = Checkpoint(path, boot_id="b")
    await same_boot.load()
    await same_boot.put("uid-2", record())
    assert fsync_count() - before == 0
    unmarked = Checkpoint(root / "other" / "checkpoint.json", boot_id="")
    await unmarked.load()
    before = fsync_count()
    await unmarked.put("uid-1", record())
    assert fsync_count() - before == 2 and not (root / "other" / "checkpoint.boot").exists()


async def test_a_checkpoint_torn_by_a_power_loss_is_dropped_as_a_reboot_not_quarantined(root: Path) -> None:
    """The writes of a boot are not synced, so a power loss may leave the file torn or empty. The marker
    names the boot that wrote it: under a new boot id the unreadable file is state of the past boot,
    dropped (no corrupt-checkpoint report), and the preparation sequence does not go back. The same file
    under the boot the marker names is corruption: quarantined as before."""
    path = root / "checkpoint.json"
    cp = Checkpoint(path, boot_id="before")
    await cp.load()
    cp.preparation_seq -= 60_000  # a sequence started a minute before the power loss (module doc: the clock)
    await cp.put("uid-1", record())
    used = cp.next_preparation()
    for torn in (b"", b'{"apiVersion": "checkpoint.gpu.nvidia.com/v1", "preparedCl'):
        path.write_bytes(torn)
        (root / "checkpoint.boot").write_text("before\n")
        after = Checkpoint(path, boot_id="after")
        await after.load()
        assert after.claims == {} and after.torn_by_reboot and after.quarantined is None
        assert after.preparation_seq > used
        assert json.loads(path.read_text())["nodeBootID"] == "after"
        assert (root / "checkpoint.boot").read_text() == "after\n"
    path.write_bytes(b"\x00torn")
    same_boot = Checkpoint(path, boot_id="after")
    await same_boot.load()
    assert same_boot.quarantined is not None and not same_boot.torn_by_reboot
    same_boot.quarantined.unlink()


async def test_a_power_loss_that_lost_the_last_renames_is_a_reboot_and_the_claim_prepares_again(
    claims: MemoryClaims, root: Path
) -> None:
    """What a power loss can leave without directory fsyncs and spec fsyncs: the checkpoint as it was before
    the prepare (its rename lost), the outbox without the prepare's events, no CDI spec (its rename lost too)
    and a torn spec of a claim no one prepares again. The boot id changed, so the state is dropped,
    the preparation sequence does not go back, and the kubelet's prepare writes the spec again."""
    (root / "host" / "dev").mkdir(parents=True)
    (root / "host" / "dev" / "nvidia0").touch()
    claim = claims.add(claim_doc(name="survivor", results=[("gpu", "gpu-0")]))
    async with running_node(claims, root, dev_root=str(root / "host")) as node:
        cp_path, outbox_path = node.service.checkpoint.path, node.service.plugin_dir / "outbox.jsonl"
        before_prepare = cp_path.read_bytes()
        outbox_before = outbox_path.read_bytes() if outbox_path.exists() else b""
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        used = node.service.checkpoint.claims[claim.uid].preparation
        spec = node.service.plugin.preparer.cdi.path_for(claim.uid)
        assert spec.exists()
    cp_path.write_bytes(before_prepare)
    outbox_path.write_bytes(outbox_before)  # the outbox has no fsync of its own either
    spec.unlink()
    gone = spec.with_name("k8s.gpu.nvidia.com-claim_0e1f-gone.json")  # a claim whose pod went meanwhile
    gone.write_bytes(b'{"cdiVersion": "0.5.0", "kind": "k8s.gpu.nvid')  # torn: its data never reached the disk
    temp = spec.with_name(".k8s.gpu.nvidia.com-claim_0e1f-gone.json.4242.tmp")
    temp.write_bytes(b"")
    other_kind = spec.with_name("k8s.compute-domain.nvidia.com-claim_0e1f-gone.json")
    other_kind.write_text("{}")  # another driver's: not ours to sweep
    (root / "boot_id").write_text("after-the-power-loss\n")
    async with running_node(claims, root, dev_root=str(root / "host")) as node:
        assert node.service.checkpoint.claims == {} and node.service.checkpoint.wiped_for_reboot == 0
        assert node.service.checkpoint.preparation_seq > used
        assert not gone.exists() and not temp.exists() and other_kind.exists()
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        assert json.loads(spec.read_text())["devices"][0]["name"] == f"{claim.uid}-gpu-0"
        assert node.service.checkpoint.claims[claim.uid].preparation > used


async def test_a_caller_cancelled_during_a_group_write_does_not_stop_the_others(root: Path) -> None:
    path = root / "checkpoint.json"
    cp = Checkpoint(path, boot_id="b")
    await cp.load()
    first = asyncio.create_task(cp.put("cancelled", record()))
    second = asyncio.create_task(cp.put("kept", record()))
    await asyncio.sleep(0)  # both queued, the committer started
    first.cancel()
    await second
    assert first.cancelled()
    third = asyncio.create_task(cp.put("later", record()))
    await third
    assert set(json.loads(path.read_text())["preparedClaims"]) == {"cancelled", "kept", "later"}


async def test_a_staged_change_goes_out_with_the_next_write_whoever_makes_it(root: Path) -> None:
    """A PrepareStarted with nothing to undo is staged: no write of its own; the next write (another
    claim's, or its own PrepareCompleted) persists it with its events, in order; a failed write keeps the
    staged events for the write after it."""

    class Recording:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def write_sync(self, records: Sequence[Any], *, wait: bool = True) -> list[Any]:
            self.lines.extend(records)
            return list(records)

        def committed(self, records: Sequence[Any]) -> None:
            pass

    path = root / "cp" / "checkpoint.json"
    cp = Checkpoint(path, boot_id="b")
    await cp.load()
    journal = Recording()
    cp.journal = journal
    before = cp.writes
    cp.stage("a", record("PrepareStarted"), events=["a:prepare-started"])
    assert cp.writes == before and "a" in cp.claims  # in memory, seen by guards
    assert "a" not in (json.loads(path.read_text())["preparedClaims"] if path.exists() else {})
    await cp.put("b", record(), events=["b:prepared"])
    assert cp.writes - before == 1
    assert json.loads(path.read_text())["preparedClaims"]["a"]["state"] == "PrepareStarted"
    assert journal.lines == ["a:prepare-started", "b:prepared"]
    # a write that fails before its events reach the journal keeps the staged ones for the next write
    cp.stage("c", record("PrepareStarted"), events=["c:prepare-started"])
    cp.journal = None
    shutil.rmtree(path.parent)
    try:
        await cp.put("d", record())
    except CheckpointError:
        pass
    else:
        raise AssertionError("the write into a removed directory succeeded")
    path.parent.mkdir()
    cp.journal = journal
    await cp.put("c", record(), events=["c:prepared"])
    assert journal.lines[2:] == ["c:prepare-started", "c:prepared"]
    assert json.loads(path.read_text())["preparedClaims"]["c"]["state"] == "PrepareCompleted"


async def test_the_device_gpu_and_daemon_queries_follow_every_change(root: Path) -> None:
    """`holders`, `gpu_holders` and `daemon_users` answer from an index kept by put, stage, remove, a failed
    write's restore and load: what a walk over every record would find, in the records' order."""

    def share(device: str, uuid: str, daemon: str = "", parent: str = "") -> PreparedDevice:
        return PreparedDevice(
            requests=["gpu"], pool="n1", device=device, uuid=uuid, parent_uuid=parent, mps_daemon=daemon
        )

    def found(rows: Iterable[tuple[str, ClaimRecord, PreparedDevice]]) -> list[tuple[str, str]]:
        return [(uid, dev.device) for uid, _, dev in rows]

    path = root / "cp" / "checkpoint.json"
    cp = Checkpoint(path, boot_id="b")
    await cp.load()
    a = ClaimRecord(state="PrepareCompleted", name="a", namespace="ns", devices=[share("gpu-0", "GPU-0", "d0")])
    await cp.put("a", a)
    mig = share("gpu-0-mig-1g", "", parent="GPU-0")
    cp.stage("b", ClaimRecord(state="PrepareStarted", name="b", namespace="ns", devices=[mig]))
    assert found(cp.holders("gpu-0")) == [("a", "gpu-0")] and found(cp.holders("gpu-0", exclude="a")) == []
    assert found(cp.gpu_holders("GPU-0")) == [("a", "gpu-0"), ("b", "gpu-0-mig-1g")]
    assert found(cp.daemon_users("d0", exclude="b")) == [("a", "gpu-0")] and found(cp.daemon_users("d1")) == []
    mig.uuid = "MIG-1"  # a dynamic MIG device's UUID, set in place and then written
    await cp.put("b", cp.claims["b"])
    assert found(cp.gpu_holders("MIG-1")) == [("b", "gpu-0-mig-1g")]
    await cp.put(
        "a", ClaimRecord(state="PrepareCompleted", name="a", namespace="ns", devices=[share("gpu-1", "GPU-1")])
    )
    assert (
        cp.holders("gpu-0") == []
        and found(cp.daemon_users("d0")) == []
        and found(cp.gpu_holders("GPU-0")) == [("b", "gpu-0-mig-1g")]
    )
    shutil.rmtree(path.parent)  # the next write fails: the records (and the answers) are restored
    results = await asyncio.gather(cp.remove("b"), cp.put("c", a), return_exceptions=True)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert found(cp.gpu_holders("GPU-0")) == [("b", "gpu-0-mig-1g")] and cp.holders("gpu-0") == []
    path.parent.mkdir()
    await cp.remove("b")
    assert cp.gpu_holders("GPU-0") == [] and found(cp.holders("gpu-1")) == [("a", "gpu-1")]
    again = Checkpoint(path, boot_id="b")
    await again.load()
    assert found(again.holders("gpu-1")) == [("a", "gpu-1")] and found(again.gpu_holders("GPU-1")) == [("a", "gpu-1")]


async def test_holds_name_one_holder_per_way_a_device_is_held_whatever_the_number_of_holders(root: Path) -> None:
    """`holds` and `gpu_holds` answer the guard with one holder per `Hold`: 40 MPS shares of one GPU with the
    same daemon settings are one answer, a share with other settings or an exclusive holder another; the
    excluded claim is never the answer, and removing the holder that stood for a hold lets the next stand."""

    def device(
        name: str, *, share: str = "", settings: dict[str, int] | None = None, parent: str = ""
    ) -> PreparedDevice:
        return PreparedDevice(
            requests=["gpu"],
            pool="n1",
            device=name,
            uuid="" if parent else "GPU-0",
            parent_uuid=parent,
            shared=bool(share),
            share_id=share,
            sharing="MPS" if share else "",
            mps_daemon="d0" if share else "",
            mps_daemon_settings=settings or {},
        )

    def record(dev: PreparedDevice) -> ClaimRecord:
        return ClaimRecord(state="PrepareCompleted", name="c", namespace="ns", devices=[dev])

    def found(rows: list[tuple[str, ClaimRecord, PreparedDevice]]) -> list[tuple[str, str]]:
        return [(uid, dev.share_id) for uid, _, dev in rows]

    cp = Checkpoint(root / "cp" / "checkpoint.json", boot_id="b")
    await cp.load()
    for n in range(40):
        cp.stage(f"s{n}", record(device("gpu-0", share=f"share-{n}")))
    await cp.save()
    assert len(cp.holders("gpu-0")) == 40
    assert found(cp.holds("gpu-0")) == [("s0", "share-0")] and found(cp.gpu_holds("GPU-0")) == [("s0", "share-0")]
    assert found(cp.holds("gpu-0", exclude="s0")) == [("s1", "share-1")]
    await cp.put("odd", record(device("gpu-0", share="share-odd", settings={"activeThreadPercentage": 50})))
    cp.stage("mig", record(device("gpu-0-mig-1g", parent="GPU-0")))
    assert found(cp.holds("gpu-0")) == [("s0", "share-0"), ("odd", "share-odd")]
    assert found(cp.gpu_holds("GPU-0")) == [("s0", "share-0"), ("odd", "share-odd"), ("mig", "")]
    await cp.remove("s0")
    await cp.remove("odd")
    assert found(cp.holds("gpu-0")) == [("s1", "share-1")]
    await asyncio.gather(*(cp.remove(f"s{n}") for n in range(1, 40)))
    assert cp.holds("gpu-0") == [] and found(cp.gpu_holds("GPU-0")) == [("mig", "")]
    again = Checkpoint(root / "cp" / "checkpoint.json", boot_id="b")
    await again.load()
    assert found(again.gpu_holds("GPU-0")) == [("mig", "")]
