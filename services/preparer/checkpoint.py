"""Durable prepared-claim state: `<plugin dir>/checkpoint.json`, the preparer's crash-recovery backbone.

Owns the two-phase record per claim (`PrepareStarted` -> `PrepareCompleted`), the schema version,
the node boot id (a reboot wipes prepared state), crash-safe replacement (temp file, fsync, rename,
fsync of the directory) and quarantine of a corrupt file. Decoding is forward-tolerant: fields a
newer version wrote are kept on rewrite, never rejected, and there is no checksum over re-serialised
JSON (the upstream driver's crash loop, NVIDIA/k8s-dra-driver-gpu#1080).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from shared.files import atomic_write as atomic_write  # re-exported: cdi, devices
from shared.files import read_boot_id as read_boot_id  # re-exported: the service
from shared.logs import get_logger
from shared.telemetry import get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)

API_VERSION = "checkpoint.gpu.nvidia.com/v1"
KIND = "PreparerCheckpoint"
SCHEMA_VERSION = 1

ClaimState = Literal["PrepareStarted", "PrepareCompleted"]


class PreparedDevice(msgspec.Struct, kw_only=True):
    """One device as returned to the kubelet, plus what unprepare needs to undo it."""

    requests: list[str]  # top-level request names
    pool: str
    device: str
    cdi_device_ids: list[str] = msgspec.field(default_factory=list)
    kind: str = "gpu"  # gpu | mig
    uuid: str = ""
    parent_uuid: str = ""  # MIG: the physical GPU
    sharing: str = ""  # "" | TimeSlicing | MPS
    shared: bool = False  # config allows another claim to hold this device too
    admin_access: bool = False
    dynamic_mig: bool = False  # created by this claim's prepare, destroyed by its unprepare
    share_id: str = ""


class ClaimRecord(msgspec.Struct, kw_only=True):
    """A claim's state on this node."""

    state: ClaimState
    name: str
    namespace: str
    generation: int = 1  # bumps on each fresh prepare attempt (event de-duplication)
    devices: list[PreparedDevice] = msgspec.field(default_factory=list)
    configs: list[dict[str, Any]] = msgspec.field(default_factory=list)  # decoded opaque configs applied
    mps_daemon_id: str = ""
    timesliced_gpus: list[str] = msgspec.field(default_factory=list)  # UUIDs reset on unprepare
    cdi_spec: str = ""  # file name in the CDI dir
    started_at: float = 0.0
    completed_at: float = 0.0


class _Known(msgspec.Struct, kw_only=True):
    """The top-level fields this version understands (others are carried through untouched)."""

    apiVersion: str = API_VERSION
    kind: str = KIND
    schemaVersion: int = SCHEMA_VERSION
    nodeBootID: str = ""
    preparedClaims: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)


class CheckpointError(RuntimeError):
    """The checkpoint could not be written (disk full, permissions): the operation must fail."""


class Checkpoint:
    """In-memory claim records mirrored to one JSON file; every mutation is written before it returns."""

    def __init__(self, path: Path, *, boot_id: str) -> None:
        self.path = Path(path)
        self.boot_id = boot_id
        self.claims: dict[str, ClaimRecord] = {}
        self._raw_top: dict[str, Any] = {}
        self._raw_claims: dict[str, dict[str, Any]] = {}
        self._write_lock = asyncio.Lock()
        self.quarantined: Path | None = None  # where a corrupt file was moved at load
        self.corrupt_reason = ""
        self.wiped_for_reboot = 0

    # -- loading ---------------------------------------------------------------------------
    def _quarantine(self, reason: str) -> None:
        target = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        with contextlib.suppress(OSError):
            os.replace(self.path, target)
        self.quarantined = target
        self.corrupt_reason = reason
        log.error("checkpoint is corrupt; moved aside and starting empty (claims will be re-prepared)",
                  path=str(self.path), quarantined_to=str(target), reason=reason)

    def _load_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        try:
            top = msgspec.json.decode(data)
            if not isinstance(top, dict):
                raise ValueError(f"top level is {type(top).__name__}, not an object")
            known = msgspec.convert(top, _Known)
            claims: dict[str, ClaimRecord] = {}
            for uid, raw in known.preparedClaims.items():
                if not isinstance(raw, dict):
                    raise ValueError(f"claim {uid} is {type(raw).__name__}, not an object")
                claims[uid] = msgspec.convert(raw, ClaimRecord)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self._quarantine(str(exc))
            return
        if known.schemaVersion > SCHEMA_VERSION:
            log.warning("checkpoint written by a newer schema; unknown fields are kept as they are",
                        schema_version=known.schemaVersion, ours=SCHEMA_VERSION)
        self._raw_top = top
        self._raw_claims = dict(known.preparedClaims)
        if known.nodeBootID and self.boot_id and known.nodeBootID != self.boot_id:
            self.wiped_for_reboot = len(claims)
            log.warning("node rebooted since the checkpoint was written; prepared state wiped",
                        stored_boot_id=known.nodeBootID, boot_id=self.boot_id, claims=len(claims))
            self._raw_claims = {}
            return
        self.claims = claims

    async def load(self) -> None:
        """Read the file (missing = empty); quarantine a corrupt one; wipe after a reboot; write back."""
        await asyncio.to_thread(self._load_sync)
        await self.save()

    # -- writing ---------------------------------------------------------------------------
    def _document(self) -> bytes:
        top = dict(self._raw_top)
        top.update(apiVersion=API_VERSION, kind=KIND, schemaVersion=max(SCHEMA_VERSION, int(
            top.get("schemaVersion", SCHEMA_VERSION) or SCHEMA_VERSION)), nodeBootID=self.boot_id)
        prepared: dict[str, Any] = {}
        for uid, record in self.claims.items():
            merged = dict(self._raw_claims.get(uid, {}))
            merged.update(msgspec.to_builtins(record))
            prepared[uid] = merged
        top["preparedClaims"] = prepared
        return msgspec.json.format(msgspec.json.encode(top), indent=1)

    async def save(self) -> None:
        with tracer.start_as_current_span("checkpoint.write") as span:
            span.set_attribute("checkpoint.claims", len(self.claims))
            async with self._write_lock:
                data = self._document()
                try:
                    await asyncio.to_thread(atomic_write, self.path, data)
                except OSError as exc:
                    raise CheckpointError(f"cannot write checkpoint {self.path}: {exc}") from exc

    async def put(self, uid: str, record: ClaimRecord) -> None:
        previous = self.claims.get(uid)
        self.claims[uid] = record
        try:
            await self.save()
        except CheckpointError:
            if previous is None:
                self.claims.pop(uid, None)
            else:
                self.claims[uid] = previous
            raise

    async def remove(self, uid: str) -> None:
        previous = self.claims.pop(uid, None)
        self._raw_claims.pop(uid, None)
        if previous is None:
            return
        try:
            await self.save()
        except CheckpointError:
            self.claims[uid] = previous
            raise

    # -- queries ---------------------------------------------------------------------------
    def holders(self, device: str, *, exclude: str = "") -> list[tuple[str, ClaimRecord, PreparedDevice]]:
        """Claims (other than `exclude`) that hold or are preparing `device`."""
        out = []
        for uid, record in self.claims.items():
            if uid == exclude:
                continue
            for dev in record.devices:
                if dev.device == device:
                    out.append((uid, record, dev))
        return out

    def by_state(self, state: ClaimState) -> dict[str, ClaimRecord]:
        return {uid: r for uid, r in self.claims.items() if r.state == state}
