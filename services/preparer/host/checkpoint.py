"""Durable prepared-claim state: `<plugin dir>/checkpoint.json`, the preparer's crash-recovery backbone.

Owns the two-phase record per claim (`PrepareStarted` -> `PrepareCompleted`), the schema version, the node
boot id, the node's preparation sequence (`preparationSeq`, in every claim event id; it never goes back),
crash-safe replacement and quarantine of a corrupt file. Decoding is forward-tolerant: fields a newer version
wrote are kept on rewrite, and there is no checksum over re-serialised JSON (NVIDIA/k8s-dra-driver-gpu#1080).

Group commit: every change made while a write is on its way goes out in the next one (one temp file, one
rename), each caller resuming once its change is on disk; a failed write fails every change it carried. A
write may carry records for a `Journal` (the lifecycle-event outbox), appended just before the replacement.

What a crash loses: docs/architecture.md. In short, a rename survives a process crash, and a power loss is a
reboot, after which no claim is prepared: the boot id is recorded once per boot (`checkpoint.boot`, the only
fsync), a checkpoint of another boot is wiped at load, so other writes need no fsync (without a readable boot
id every write syncs). Small writes go on the event loop (`INLINE_MAX_BYTES`) through two slot files
(`shared.files.SlotFile`). A `PrepareStarted` that creates nothing before its CDI spec is staged (`stage`),
carried by the next write, so a plain prepare is one write.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Protocol

import msgspec

from shared.files import BootMarker, SlotFile
from shared.files import atomic_write as atomic_write  # re-exported: cdi, devices
from shared.files import read_boot_id as read_boot_id  # re-exported: the service
from shared.logs import get_logger
from shared.telemetry import get_tracer, leaf_span

log = get_logger(__name__)
tracer = get_tracer(__name__)

API_VERSION = "checkpoint.gpu.nvidia.com/v1"
KIND = "PreparerCheckpoint"
SCHEMA_VERSION = 1
INLINE_MAX_BYTES = 256 << 10  # an unsynced write up to this size is made on the event loop (module doc)

ClaimState = Literal["PrepareStarted", "PrepareCompleted"]


class PreparedDevice(msgspec.Struct, kw_only=True):
    """One device as returned to the kubelet, plus what unprepare needs to undo it."""

    requests: list[str]  # top-level request names
    pool: str
    device: str
    cdi_device_ids: list[str] = msgspec.field(default_factory=list)
    kind: str = "gpu"  # gpu | mig | vfio
    uuid: str = ""
    parent_uuid: str = ""  # MIG: the physical GPU
    sharing: str = ""  # "" | TimeSlicing | MPS
    # a time-sliced full GPU: the interval this claim set on it ("" in records written before 2026-12-07)
    time_slice_interval: str = ""
    shared: bool = False  # config allows another claim to hold this device too
    admin_access: bool = False
    dynamic_mig: bool = False  # made on demand for its claims: by the first one prepared, destroyed after the last
    share_id: str = ""  # KEP-5075: this claim holds a share of the device, not all of it
    consumed_capacity: dict[str, str] = msgspec.field(default_factory=dict)  # the share's, as allocated
    capacity: dict[str, str] = msgspec.field(default_factory=dict)  # a share's device's whole (memory, compute)
    # A share served by MPS: the GPU's one daemon (shared by every share of it, stopped after the last
    # share's undo: reference counted over the checkpoint's records) and the settings it was started with.
    mps_daemon: str = ""
    mps_daemon_settings: dict[str, int] = msgspec.field(default_factory=dict)
    # VFIO: the GPU's PCI address, on disk before it leaves nvidia (the undo gives it back) and its IOMMU group
    pci_bus_id: str = ""
    iommu_group: int = -1


# How a claim holds a device: its kind, whether it shares it, admin access, whether it holds a share, the
# sharing mode, the settings of the MPS daemon its share uses and the time-slice interval it set. Whether another
# claim may hold the device too depends on nothing else, so one holder of each way stands for all its holders
# (`Checkpoint.holds`).
Hold = tuple[str, bool, bool, bool, str, tuple[tuple[str, int], ...], str]


def hold_of(dev: PreparedDevice) -> Hold:
    """How a claim holds `dev` (`Hold`)."""
    settings = tuple(sorted(dev.mps_daemon_settings.items())) if dev.mps_daemon_settings else ()
    return (
        dev.kind,
        dev.shared,
        dev.admin_access,
        bool(dev.share_id),
        dev.sharing,
        settings,
        dev.time_slice_interval,
    )


class ClaimRecord(msgspec.Struct, kw_only=True):
    """A claim's state on this node."""

    state: ClaimState
    name: str
    namespace: str
    generation: int = 1  # no longer used (event ids carry `preparation`); kept for older readers
    preparation: int = 0  # the node's preparation sequence when this preparation started (0: before 2026-12)
    devices: list[PreparedDevice] = msgspec.field(default_factory=list)
    configs: list[dict[str, Any]] = msgspec.field(default_factory=list)  # decoded opaque configs applied
    mps_daemon_id: str = ""
    timesliced_gpus: list[str] = msgspec.field(default_factory=list)  # UUIDs reset on unprepare
    fabric_partition: int = -1  # the NVLink partition activated for the claim (-1: none); on disk before the call
    cdi_spec: str = ""  # file name in the CDI dir
    started_at: float = 0.0
    completed_at: float = 0.0
    traceparent: str = ""  # the claim's trace context when it was prepared: its unprepare links to it


class _Known(msgspec.Struct, kw_only=True):
    """The top-level fields this version understands (others are carried through untouched)."""

    apiVersion: str = API_VERSION
    kind: str = KIND
    schemaVersion: int = SCHEMA_VERSION
    nodeBootID: str = ""
    preparationSeq: int = 0
    preparedClaims: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)


class Journal(Protocol):
    """Where the records a checkpoint write carries go (the lifecycle-event outbox)."""

    def write_sync(self, records: Sequence[Any], *, wait: bool = True) -> list[Any] | None:
        """Append `records` (in the checkpoint's write step, before its replacement); those kept. With
        `wait` False (on the event loop): None, having written nothing, when that would have to wait."""
        ...

    def committed(self, records: Sequence[Any]) -> None:
        """On the event loop, after the write: `records` (as `write_sync` returned them) are on file."""
        ...


def _fresh_sequence() -> int:
    """Where the preparation sequence starts without a readable checkpoint: milliseconds since the epoch,
    above any sequence an earlier (lost or corrupt) checkpoint of this node can have reached."""
    return int(time.time() * 1000)


class CheckpointError(RuntimeError):
    """The checkpoint could not be written (disk full, permissions): the operation must fail."""


class Checkpoint:
    """In-memory claim records mirrored to one JSON file; every mutation is written before it returns."""

    def __init__(self, path: Path, *, boot_id: str) -> None:
        self.path = Path(path)
        self.boot_id = boot_id
        self._claims: dict[str, ClaimRecord] = {}  # changed by `_set` only, which keeps `_index` with it
        self.claims: Mapping[str, ClaimRecord] = MappingProxyType(self._claims)  # read only
        self._index = _Index()  # device name, GPU UUID, MPS daemon -> the claims whose records name it
        self._raw_top: dict[str, Any] = {}
        self._raw_claims: dict[str, dict[str, Any]] = {}
        self._encoded: dict[str, tuple[ClaimRecord, bytes]] = {}  # uid -> (record, its JSON) until it changes
        self._queue: list[tuple[Sequence[Any], asyncio.Future[int]]] = []  # changes awaiting a write
        self._staged_events: list[Any] = []  # events of staged changes: they go out with the next write
        self._events_journaled = False  # whether the last write got its events to the journal
        self._committer: asyncio.Task[None] | None = None
        self.writes = 0  # documents written (tests, benches)
        self.power_loss_is_reboot = bool(boot_id)  # a power loss shows as a new boot id at the next load
        self.sync_dir = not self.power_loss_is_reboot  # see the module doc: else a lost rename goes unnoticed
        self.sync_file = True  # until this boot's marker is on disk (module doc)
        self._slots: SlotFile | None = None  # how unsynced writes replace the file (no inode per write)
        self.marker = self.path.with_name(f"{self.path.stem}.boot")
        self.quarantined: Path | None = None  # where a corrupt file was moved at load
        self.corrupt_reason = ""
        self.wiped_for_reboot = 0
        self.torn_by_reboot = False  # the file was unreadable after a power loss (dropped, not quarantined)
        self.preparation_seq = 0  # the last preparation number handed out (next_preparation)
        self.journal: Journal | None = None  # where the records a write carries go

    # -- loading ---------------------------------------------------------------------------
    def _quarantine(self, reason: str) -> None:
        target = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        with contextlib.suppress(OSError):
            os.replace(self.path, target)
        self.quarantined = target
        self.corrupt_reason = reason
        log.error(
            "checkpoint is corrupt; moved aside and starting empty (claims will be re-prepared)",
            path=str(self.path),
            quarantined_to=str(target),
            reason=reason,
        )

    def _load_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        marker = BootMarker(self.marker, self.boot_id)
        self._read_sync(rebooted=marker.rebooted)
        if self.boot_id:
            self._mark_boot(marker)

    def _mark_boot(self, marker: BootMarker) -> None:
        """Record (durably) the boot the writes from now on belong to; then they need no fsync."""
        try:
            marker.mark()
        except OSError as exc:
            log.warning(
                "boot marker not written; every checkpoint write keeps its fsync", path=str(self.marker), error=str(exc)
            )
            return
        self.sync_file = False
        slots = SlotFile(self.path)
        try:
            slots.open()
            self._slots = slots
        except OSError as exc:  # no hard links here: a temp file and a rename per write, still unsynced
            log.info(
                "checkpoint slots not linked; each write replaces the file through a temp file",
                path=str(self.path),
                error=str(exc),
            )

    def _read_sync(self, *, rebooted: bool) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self.preparation_seq = _fresh_sequence()
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
            if rebooted:  # torn by the power loss that rebooted the node: state of a past boot (module doc)
                self.torn_by_reboot = True
                log.warning(
                    "checkpoint unreadable after a reboot (its last writes were not synced); prepared "
                    "state of the past boot dropped",
                    path=str(self.path),
                    error=str(exc),
                )
            else:
                self._quarantine(str(exc))
            self.preparation_seq = _fresh_sequence()
            return
        self.preparation_seq = known.preparationSeq or _fresh_sequence()
        if known.schemaVersion > SCHEMA_VERSION:
            log.warning(
                "checkpoint written by a newer schema; unknown fields are kept as they are",
                schema_version=known.schemaVersion,
                ours=SCHEMA_VERSION,
            )
        self._raw_top = top
        self._raw_claims = dict(known.preparedClaims)
        if known.nodeBootID and self.boot_id and known.nodeBootID != self.boot_id:
            self.wiped_for_reboot = len(claims)
            self.preparation_seq = max(self.preparation_seq, _fresh_sequence())  # a lost rename: never back
            log.warning(
                "node rebooted since the checkpoint was written; prepared state wiped",
                stored_boot_id=known.nodeBootID,
                boot_id=self.boot_id,
                claims=len(claims),
            )
            self._raw_claims = {}
            return
        for uid, record in claims.items():
            self._set(uid, record)

    async def load(self) -> None:
        """Read the file (missing = empty); quarantine a corrupt one; wipe after a reboot; write back."""
        await asyncio.to_thread(self._load_sync)
        await self.save()

    # -- writing ---------------------------------------------------------------------------
    def _claim_json(self, uid: str, record: ClaimRecord) -> bytes:
        """A claim's entry as JSON (with the fields a newer version wrote), encoded again only when the
        record was replaced or changed through `put`/`stage`: a write re-encodes what changed, not all."""
        cached = self._encoded.get(uid)
        if cached is not None and cached[0] is record:
            return cached[1]
        raw = self._raw_claims.get(uid)
        if raw is None:  # a claim this process recorded: nothing of a newer version's to keep
            data = msgspec.json.encode(record)
        else:
            merged = dict(raw)
            merged.update(msgspec.to_builtins(record))
            data = msgspec.json.encode(merged)
        self._encoded[uid] = (record, data)
        return data

    def _document(self) -> bytes:
        """The whole file: compact JSON (read it with jq), claims last."""
        top = dict(self._raw_top)
        top.update(
            apiVersion=API_VERSION,
            kind=KIND,
            schemaVersion=max(SCHEMA_VERSION, int(top.get("schemaVersion", SCHEMA_VERSION) or SCHEMA_VERSION)),
            nodeBootID=self.boot_id,
            preparationSeq=self.preparation_seq,
        )
        top.pop("preparedClaims", None)
        claims = b",".join(
            msgspec.json.encode(uid) + b":" + self._claim_json(uid, record) for uid, record in self.claims.items()
        )
        return msgspec.json.encode(top)[:-1] + b',"preparedClaims":{' + claims + b"}}"

    def next_preparation(self) -> int:
        """A new preparation number; the next write persists it (the PrepareStarted write, normally)."""
        self.preparation_seq += 1
        return self.preparation_seq

    def stage(self, uid: str, record: ClaimRecord, *, events: Sequence[Any] = ()) -> None:
        """Change a claim in memory only: the next write persists it, whoever makes it, with `events`
        in the same write (so an event is never on disk without its change, nor the change without it).
        For a change a crash may lose: a PrepareStarted of a claim that has nothing to undo (module doc)."""
        self._set(uid, record)
        self._encoded.pop(uid, None)
        self._staged_events.extend(events)

    async def save(self, events: Sequence[Any] = ()) -> None:
        """Write the document (together with every other change pending now: group commit); `events` go
        to the journal first, in the same durable step (see the module doc). Each caller's trace gets a
        `checkpoint.write` span for the write that carried its change (shared by the changes it carried)."""
        with leaf_span(tracer, "checkpoint.write", {"checkpoint.events": len(events)}) as span:
            done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._queue.append((events, done))
            if self._committer is None or self._committer.done():
                self._committer = asyncio.create_task(self._commit(), name="checkpoint-commit")
            changes = await done
            if span.is_recording():
                span.set_attributes({"checkpoint.changes": changes, "checkpoint.claims": len(self.claims)})

    async def _commit(self) -> None:
        """Write what is queued, then what queued meanwhile, until nothing is (one task at a time)."""
        while self._queue:
            batch, self._queue = self._queue, []
            staged, self._staged_events = self._staged_events, []
            error: BaseException | None = None
            try:
                await self._write(staged + [e for events, _ in batch for e in events])
            except BaseException as exc:  # noqa: BLE001 - handed to every waiter; cancellation re-raised below
                error = exc
                if not self._events_journaled:  # still only in memory: the next write carries them
                    self._staged_events[:0] = staged
            for _, done in batch:
                if done.done():
                    continue  # its caller was cancelled
                if error is None:
                    done.set_result(len(batch))
                elif isinstance(error, CheckpointError):
                    done.set_exception(error)
                else:
                    done.set_exception(CheckpointError(f"checkpoint write of {self.path} interrupted: {error!r}"))
            if error is not None and not isinstance(error, CheckpointError):
                for _, done in self._queue:
                    if not done.done():
                        done.set_exception(CheckpointError(f"checkpoint write of {self.path} interrupted"))
                self._queue = []
                raise error

    async def _write(self, events: list[Any]) -> None:
        data = self._document()
        journal = self.journal if events else None
        kept: list[Any] = []
        journaled: list[bool] = []
        sync_dir, sync_file, slots = self.sync_dir, self.sync_file, self._slots

        def write(wait: bool) -> bool:
            if journal is not None:
                got = journal.write_sync(events, wait=wait)
                if got is None:
                    return False
                kept.extend(got)
                journaled.append(True)
            if slots is not None:
                slots.write(data)
            else:
                atomic_write(self.path, data, sync_dir=sync_dir, sync_file=sync_file)
            return True

        self.writes += 1
        try:
            inline = not sync_file and not sync_dir and len(data) <= INLINE_MAX_BYTES
            if not (inline and write(False)):
                await asyncio.to_thread(write, True)
        except OSError as exc:
            raise CheckpointError(f"cannot write checkpoint {self.path}: {exc}") from exc
        finally:
            self._events_journaled = bool(journaled)
            if journal is not None and kept:
                journal.committed(kept)  # on file: sent even when the checkpoint write failed

    async def put(self, uid: str, record: ClaimRecord, *, events: Sequence[Any] = ()) -> None:
        previous = self._claims.get(uid)
        self._set(uid, record)
        self._encoded.pop(uid, None)  # changed in place, perhaps: encoded again
        try:
            await self.save(events)
        except CheckpointError:
            self._set(uid, previous)
            raise

    async def remove(self, uid: str, *, events: Sequence[Any] = ()) -> None:
        previous = self._claims.get(uid)
        self._set(uid, None)
        self._raw_claims.pop(uid, None)
        self._encoded.pop(uid, None)
        if previous is None and not events:
            return
        try:
            await self.save(events)
        except CheckpointError:
            if previous is not None:
                self._set(uid, previous)
            raise

    def _set(self, uid: str, record: ClaimRecord | None) -> None:
        """The one place a claim's record is replaced, added or (None) dropped; the index follows. A record
        changed in place (its state, a dynamic MIG device's UUID) goes through here again (`put`, `stage`)
        before anyone awaits, so the index names what the record names whenever another task looks."""
        if record is None:
            self._claims.pop(uid, None)
        else:
            self._claims[uid] = record
        self._index.update(uid, record)

    # -- queries ---------------------------------------------------------------------------
    def holders(self, device: str, *, exclude: str = "") -> list[tuple[str, ClaimRecord, PreparedDevice]]:
        """Claims (other than `exclude`) that hold or are preparing `device`."""
        return list(self._named(self._index.devices, device, exclude, lambda dev: dev.device == device))

    def gpu_holders(self, gpu_uuid: str, *, exclude: str = "") -> list[tuple[str, ClaimRecord, PreparedDevice]]:
        """Claims (other than `exclude`) holding or preparing the GPU `gpu_uuid` or one of its MIG devices."""
        return list(
            self._named(self._index.gpus, gpu_uuid, exclude, lambda dev: gpu_uuid in (dev.uuid, dev.parent_uuid))
        )

    def daemon_users(self, daemon: str, *, exclude: str = "") -> Iterator[tuple[str, ClaimRecord, PreparedDevice]]:
        """Claims (other than `exclude`) whose devices (prepared, or being prepared) use the shared MPS daemon, in
        the order they came to use it; lazily: a caller that stops at the first it wants reads no more."""
        return self._named(self._index.daemons, daemon, exclude, lambda dev: dev.mps_daemon == daemon)

    def holds(self, device: str, *, exclude: str = "") -> list[tuple[str, ClaimRecord, PreparedDevice]]:
        """One holder of `device` (other than `exclude`) for each way (`Hold`) other claims hold it: all that
        decides whether one more claim may, whatever the number of holders (a GPU of 48 MPS shares: one)."""
        return self._one_per_hold(self._index.device_holds, device, exclude)

    def gpu_holds(self, gpu_uuid: str, *, exclude: str = "") -> list[tuple[str, ClaimRecord, PreparedDevice]]:
        """`holds` of the GPU `gpu_uuid`'s devices: itself and its MIG devices."""
        return self._one_per_hold(self._index.gpu_holds, gpu_uuid, exclude)

    def _named(
        self, index: dict[str, dict[str, None]], key: str, exclude: str, match: Callable[[PreparedDevice], bool]
    ) -> Iterator[tuple[str, ClaimRecord, PreparedDevice]]:
        """(uid, record, device) of each device that `match`es in the records `index` lists under `key`."""
        return (
            (uid, self._claims[uid], dev)
            for uid in index.get(key, ())
            if uid != exclude
            for dev in self._claims[uid].devices
            if match(dev)
        )

    def _one_per_hold(
        self, index: dict[str, dict[Hold, dict[str, int]]], key: str, exclude: str
    ) -> list[tuple[str, ClaimRecord, PreparedDevice]]:
        """Per hold of `key`, its first holder other than `exclude`, with the device the index names."""
        out: list[tuple[str, ClaimRecord, PreparedDevice]] = []
        for holders in index.get(key, {}).values():
            for uid, position in holders.items():
                if uid != exclude:
                    record = self._claims[uid]
                    out.append((uid, record, record.devices[position]))
                    break
        return out

    def by_state(self, state: ClaimState) -> dict[str, ClaimRecord]:
        return {uid: r for uid, r in self._claims.items() if r.state == state}


_Keys = tuple[str, str, str, str, Hold]  # a device's name, UUID, parent UUID, daemon and how it is held


class _Index:
    """Which claims' records name a device, a GPU (a device's UUID or its parent's) or a shared MPS daemon, and
    which hold a device or a GPU each way (`Hold`), with the position in the record of the first device that
    holds it so: the guard and the daemon's reference count look up a device's claims, not walk every record.
    Per key the claims in the order they came to name it (the records' order, as a walk would find them)."""

    def __init__(self) -> None:
        self.devices: dict[str, dict[str, None]] = {}
        self.gpus: dict[str, dict[str, None]] = {}
        self.daemons: dict[str, dict[str, None]] = {}
        self.device_holds: dict[str, dict[Hold, dict[str, int]]] = {}
        self.gpu_holds: dict[str, dict[Hold, dict[str, int]]] = {}
        self._keys: dict[str, tuple[_Keys, ...]] = {}  # uid -> what its devices name

    def update(self, uid: str, record: ClaimRecord | None) -> None:
        now = (
            ()
            if record is None
            else tuple([(d.device, d.uuid, d.parent_uuid, d.mps_daemon, hold_of(d)) for d in record.devices])
        )
        was = self._keys.get(uid, ())
        if now == was:  # a record written again as it was indexed: the usual case
            return
        if now:
            self._keys[uid] = now
        else:
            del self._keys[uid]
        old, new = _named(was), _named(now)
        for index, gone, came in zip((self.devices, self.gpus, self.daemons), old[:3], new[:3], strict=True):
            for key in gone - came:
                users = index[key]
                del users[uid]
                if not users:
                    del index[key]
            for key in came - gone:
                index.setdefault(key, {})[uid] = None
        for holds, gone_held, came_held in zip((self.device_holds, self.gpu_holds), old[3:], new[3:], strict=True):
            for key, hold in gone_held.keys() - came_held.keys():
                holders = holds[key][hold]
                del holders[uid]
                if not holders:
                    del holds[key][hold]
                    if not holds[key]:
                        del holds[key]
            for (key, hold), position in came_held.items():
                if gone_held.get((key, hold)) != position:  # new, or its device moved in the record
                    holds.setdefault(key, {}).setdefault(hold, {})[uid] = position


def _named(
    keys: tuple[_Keys, ...],
) -> tuple[set[str], set[str], set[str], dict[tuple[str, Hold], int], dict[tuple[str, Hold], int]]:
    """The devices, GPUs and daemons a record's keys name, and the (device, hold) and (GPU, hold) pairs with
    the position of the first device of each."""
    device_holds: dict[tuple[str, Hold], int] = {}
    gpu_holds: dict[tuple[str, Hold], int] = {}
    for position, k in enumerate(keys):
        device_holds.setdefault((k[0], k[4]), position)
        for u in k[1:3]:
            if u:
                gpu_holds.setdefault((u, k[4]), position)
    return (
        {k[0] for k in keys},
        {u for k in keys for u in k[1:3] if u},
        {k[3] for k in keys if k[3]},
        device_holds,
        gpu_holds,
    )
