"""The kubelet emulator's state file: unsynced writes within a boot, a past boot's file dropped at load."""

from __future__ import annotations

from pathlib import Path

from embedded.nodeagent.state import ClaimRecord, DeviceRecord, StateStore
from shared.files import fsync_count


def record(uid: str) -> ClaimRecord:
    return ClaimRecord(
        namespace="ns",
        uid=uid,
        name=f"claim-{uid}",
        drivers=["gpu.nvidia.com"],
        pods=["pod-1"],
        devices=[
            DeviceRecord(request_names=["gpu"], pool="n", device="gpu-0", cdi_device_ids=["k8s.gpu.nvidia.com/claim=x"])
        ],
    )


async def test_writes_within_a_boot_are_unsynced_and_read_back(tmp_path: Path) -> None:
    store = StateStore(tmp_path, boot_id="boot-1")
    assert store.load() == []
    synced = fsync_count()
    for n in range(5):
        await store.save([record(str(i)) for i in range(n + 1)])
    assert fsync_count() == synced, "the boot is marked: state writes need no fsync"
    again = StateStore(tmp_path, boot_id="boot-1")  # the emulator restarted (same boot)
    assert [c.uid for c in again.load()] == ["0", "1", "2", "3", "4"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["claims.boot", "claims.json"]


async def test_a_past_boots_state_is_dropped_even_torn(tmp_path: Path) -> None:
    store = StateStore(tmp_path, boot_id="boot-1")
    store.load()
    await store.save([record("a")])
    after_reboot = StateStore(tmp_path, boot_id="boot-2")
    assert after_reboot.load() == [] and after_reboot.dropped_for_reboot, "nothing is prepared after a reboot"
    (tmp_path / "claims.json").write_bytes(b'{"version": 1, "claims": [{"nam')  # a power loss tore the last write
    await after_reboot.save([record("b")])
    assert [c.uid for c in StateStore(tmp_path, boot_id="boot-2").load()] == ["b"]
    (tmp_path / "claims.json").write_bytes(b'{"version": 1, "claims": [{"nam')
    third = StateStore(tmp_path, boot_id="boot-3")
    assert third.load() == [] and third.dropped_for_reboot


async def test_without_a_boot_id_every_write_is_synced(tmp_path: Path) -> None:
    store = StateStore(tmp_path, boot_id="")
    assert store.load() == []
    synced = fsync_count()
    await store.save([record("a")])
    assert fsync_count() == synced + 2, "file and directory"
    assert [c.uid for c in StateStore(tmp_path, boot_id="").load()] == ["a"]
