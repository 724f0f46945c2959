"""The kubelet emulator's memory across restarts: which claims it prepared, with which drivers, for which pods.

Owns one JSON file `<state-dir>/claims.json`, replaced whole whenever the set changes, and read back at
start-up so that pods already Running keep their claims and claims whose pods vanished while the emulator
was down get unprepared.

Crash argument (the preparer's checkpoint makes the same one, `services/preparer/host/checkpoint.py`):
- A process crash loses nothing the kernel has: each write replaces the file by a rename, so it is the old
  document or the new one. No fsync is needed for that.
- A power loss or kernel crash reboots the node, and after a reboot nothing is prepared: the preparer drops
  the claims of the past boot, and the emulator must prepare the claims of its pods again. So the file of a
  past boot is dropped at load, whichever of its last writes reached the disk and whether it is whole. Once
  per boot, before the first write, `claims.boot` records (fsync'd file and directory: the only fsyncs of a
  boot) the boot the writes belong to; at load, a marker naming another boot says the file is of a past boot.
  So writes need no fsync: they are small and made on the event loop, through two slot files kept linked
  beside it (`shared.files.SlotFile`: no file created or freed per write). Without a readable boot id each
  write fsyncs a temp file and the directory in a worker thread, as before.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from shared.files import BootMarker, SlotFile, atomic_write, read_boot_id
from shared.logs import get_logger

log = get_logger(__name__)


class DeviceRecord(msgspec.Struct, kw_only=True):
    request_names: list[str]
    pool: str
    device: str
    cdi_device_ids: list[str]
    share_id: str | None = None


class ClaimRecord(msgspec.Struct, kw_only=True):
    namespace: str
    uid: str
    name: str
    drivers: list[str]
    devices: list[DeviceRecord]
    pods: list[str]


class StateFile(msgspec.Struct, kw_only=True):
    version: int = 1
    claims: list[ClaimRecord] = msgspec.field(default_factory=list)


_ENCODER = msgspec.json.Encoder()


class StateStore:
    """`claims.json` under the state dir; `None` dir keeps nothing (tests, throwaway nodes)."""

    def __init__(self, state_dir: Path | None, boot_id: str | None = None) -> None:
        self.path = state_dir / "claims.json" if state_dir is not None else None
        self.marker = state_dir / "claims.boot" if state_dir is not None else None
        self.boot_id = read_boot_id() if boot_id is None else boot_id
        self._slots: SlotFile | None = None  # set once this boot is marked: writes unsynced, on the loop
        self.dropped_for_reboot = False  # the file found at load was of a past boot (tests, logs)

    def load(self) -> list[ClaimRecord]:
        """What the file holds (nothing when it is of a past boot); then marks this boot for the writes."""
        if self.path is None or self.marker is None:
            return []
        marker = BootMarker(self.marker, self.boot_id)
        claims: list[ClaimRecord] = []
        if marker.rebooted:
            self.dropped_for_reboot = self.path.exists()
            if self.dropped_for_reboot:
                log.info(
                    "kubelet state file is of a past boot; nothing is prepared after a reboot: dropped",
                    path=str(self.path),
                )
        elif self.path.exists():
            try:
                claims = msgspec.json.decode(self.path.read_bytes(), type=StateFile).claims
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning(
                    "kubelet state file unreadable; starting empty (delete it to silence this)",
                    path=str(self.path),
                    error=str(exc),
                )
        if self.boot_id:
            self._mark_boot(marker)
        return claims

    def _mark_boot(self, marker: BootMarker) -> None:
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            marker.mark()
            slots = SlotFile(self.path)
            slots.open()
            self._slots = slots
        except OSError as exc:
            log.warning(
                "kubelet state boot not marked; every state write keeps its fsync",
                path=str(self.marker),
                error=str(exc),
            )

    async def save(self, claims: list[ClaimRecord]) -> None:
        if self.path is None:
            return
        data = _ENCODER.encode(StateFile(claims=claims))
        if self._slots is not None:
            self._slots.write(data)  # small and unsynced: on the loop (module doc)
            return
        await asyncio.to_thread(_write_synced, self.path, data)


def _write_synced(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)
