"""The kubelet emulator's memory across restarts: which claims it prepared, with which drivers, for which pods.

Owns one JSON file `<state-dir>/claims.json`, written atomically (temp file + rename, off the event loop)
whenever the set changes, and read back at start-up so that pods already Running keep their claims
and claims whose pods vanished while the emulator was down get unprepared.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec

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


class StateStore:
    """`claims.json` under the state dir; `None` dir keeps nothing (tests, throwaway nodes)."""

    def __init__(self, state_dir: Path | None) -> None:
        self.path = state_dir / "claims.json" if state_dir is not None else None

    def load(self) -> list[ClaimRecord]:
        if self.path is None or not self.path.exists():
            return []
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=StateFile).claims
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("kubelet state file unreadable; starting empty (delete it to silence this)",
                        path=str(self.path), error=str(exc))
            return []

    async def save(self, claims: list[ClaimRecord]) -> None:
        if self.path is None:
            return
        data = msgspec.json.encode(StateFile(claims=claims))
        await asyncio.to_thread(_write_atomic, self.path, data)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
