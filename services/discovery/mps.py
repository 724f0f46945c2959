"""MPS control daemons for sets of GPUs or MIG devices: their records, dirs and lifecycle (start, stop, reconcile).

Owns the daemon records (`<mps_root>/<id>/daemon.json`, `MpsDaemonRecord`) and the per-daemon dirs
beside them (`pipe/`, `shm/`, `log/`). The record is written before the daemon starts and removed
last when it stops, so whatever a crash interrupts, the record (and the daemon's pid file in its
pipe dir) lets a later `stop` find and end the daemon. On a real node, or with a driver root under
simulation, the daemon is a process (services.discovery.mpsdaemon); under simulation without a driver
root no process runs and the simulated NVML keeps a copy of the record.

Who decides that a daemon should exist is the preparer: its checkpoint names the daemon before the
start request, and its rollback or unprepare asks for the stop. Here, at start, `reconcile` only
cleans records whose daemon is gone (a reboot, or discovery's container restarted, which ends the
processes it started).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path
from typing import Literal

import msgspec

from services.discovery.mpsdaemon import READY_QUERY, MpsControl
from services.discovery.nvml import Nvml, NvmlOpError
from shared.drivertools import ToolError
from shared.events.devices import MpsStartRequest
from shared.files import atomic_write
from shared.logs import get_logger

log = get_logger(__name__)

RECORD = "daemon.json"


class MpsDaemonRecord(msgspec.Struct, kw_only=True):
    """One MPS control daemon this node runs (or is starting) for a set of GPUs."""

    daemon_id: str
    gpu_uuids: list[str]
    active_thread_percentage: int | None = None
    pinned_device_memory_limits: dict[str, int] = msgspec.field(default_factory=dict)  # uuid -> bytes
    pipe_dir: str
    shm_dir: str
    log_dir: str
    # the physical GPUs whose compute mode the daemon needs in ExclusiveProcess: gpu_uuids themselves, or
    # for a daemon on MIG devices (mig+mps) their parents, as compute mode is the physical GPU's
    mode_gpus: list[str] = msgspec.field(default_factory=list)
    state: Literal["starting", "ready"] = "starting"
    pid: int = 0  # the control daemon's pid once started (its pid file in pipe_dir is the other source)
    created_at: float = 0.0


class MpsManager:
    def __init__(self, root: Path, nvml: Nvml, control: MpsControl | None = None):
        self.root = Path(root)
        self.nvml = nvml
        self.control = control
        self._records: dict[str, MpsDaemonRecord] = {}

    # ------------------------------------------------------------------ records
    def _dir(self, daemon_id: str) -> Path:
        if not daemon_id or "/" in daemon_id or daemon_id.startswith("."):
            raise NvmlOpError("invalid-argument", f"MPS daemon id {daemon_id!r} must be a plain name")
        return self.root / daemon_id

    def _load_sync(self) -> dict[str, MpsDaemonRecord]:
        out: dict[str, MpsDaemonRecord] = {}
        if not self.root.is_dir():
            return out
        for path in sorted(self.root.glob(f"*/{RECORD}")):
            try:
                d = msgspec.json.decode(path.read_bytes(), type=MpsDaemonRecord)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("unreadable MPS daemon record ignored", path=str(path), error=str(exc))
                continue
            out[d.daemon_id] = d
        return out

    async def load(self) -> None:
        self._records = await asyncio.to_thread(self._load_sync)

    async def _write(self, d: MpsDaemonRecord) -> None:
        base = self._dir(d.daemon_id)

        def write() -> None:
            base.mkdir(parents=True, exist_ok=True)
            atomic_write(base / RECORD, msgspec.json.encode(d))

        await asyncio.to_thread(write)
        self._records[d.daemon_id] = d

    def daemons(self) -> dict[str, MpsDaemonRecord]:
        return dict(self._records)

    def by_gpu(self) -> dict[str, str]:
        return {u: d.daemon_id for d in self._records.values() for u in d.gpu_uuids}

    # ------------------------------------------------------------------ lifecycle
    def _mode_users(self, exclude: str) -> set[str]:
        """The physical GPUs other daemons keep in ExclusiveProcess."""
        return {g for d in self._records.values() if d.daemon_id != exclude for g in (d.mode_gpus or d.gpu_uuids)}

    async def start(self, req: MpsStartRequest, known_uuids: set[str],
                    parents: dict[str, str] | None = None) -> MpsDaemonRecord:
        """Start (or confirm) the daemon; on failure nothing of it is left. Idempotent: a start of a running
        daemon with the same GPUs and settings confirms it (one daemon per GPU serves all of its shares:
        the first share's prepare starts it, a later one asks unless the preparer knows it runs, see its
        `_running_share_daemon`), one with other settings is refused.

        `parents` maps a MIG device's UUID to its GPU's (mig+mps): such a daemon serves MIG devices
        (CUDA_VISIBLE_DEVICES=MIG-<uuid>) while their parent GPU is set to ExclusiveProcess, and a
        parent's mode goes back to Default only when no other daemon uses that GPU or its MIG devices."""
        base = self._dir(req.daemon_id)
        parents = parents or {}
        known_uuids = known_uuids | set(parents)
        unknown = [u for u in req.gpu_uuids if u not in known_uuids]
        if unknown or not req.gpu_uuids:
            raise NvmlOpError("not-found", f"unknown GPU UUIDs for MPS: {unknown or 'none given'}")
        if req.active_thread_percentage is not None and not 1 <= req.active_thread_percentage <= 100:
            raise NvmlOpError("invalid-argument", "active_thread_percentage must be within 1..100")
        existing = self._records.get(req.daemon_id)
        if existing is not None:
            if sorted(existing.gpu_uuids) != sorted(req.gpu_uuids):
                raise NvmlOpError("invalid-argument", f"MPS daemon {req.daemon_id} already serves other GPUs")
            if existing.active_thread_percentage != req.active_thread_percentage or (
                    req.pinned_device_memory_limits
                    and existing.pinned_device_memory_limits != dict(req.pinned_device_memory_limits)):
                # one daemon serves many shares of a GPU: a start with other settings (limits named and
                # different, or another percentage) asks for another daemon, which the GPU cannot have
                raise NvmlOpError("in-use", f"MPS daemon {req.daemon_id} already runs with other settings "
                                            f"(active thread percentage {existing.active_thread_percentage}, "
                                            f"pinned limits {existing.pinned_device_memory_limits})")
            if existing.state == "ready" and (self.control is None or await self.control.running_pid(existing)):
                return existing
            log.info("MPS daemon record without a ready daemon; starting it again", daemon=req.daemon_id)
            await self._teardown(existing)
        taken = self.by_gpu()
        busy = [u for u in req.gpu_uuids if u in taken]
        if busy:
            raise NvmlOpError("in-use", f"GPUs {busy} are already served by MPS daemon {taken[busy[0]]}")
        d = MpsDaemonRecord(daemon_id=req.daemon_id, gpu_uuids=list(req.gpu_uuids),
                            active_thread_percentage=req.active_thread_percentage,
                            pinned_device_memory_limits=dict(req.pinned_device_memory_limits),
                            mode_gpus=sorted({parents.get(u, u) for u in req.gpu_uuids}),
                            pipe_dir=str(base / "pipe"), shm_dir=str(base / "shm"), log_dir=str(base / "log"),
                            created_at=time.time())
        await self._write(d)  # before the daemon exists: a crash from here on leaves a record to stop
        try:
            for sub in (d.pipe_dir, d.shm_dir, d.log_dir):
                await asyncio.to_thread(Path(sub).mkdir, parents=True, exist_ok=True)
            for u in d.mode_gpus or d.gpu_uuids:
                await self.nvml.call(self.nvml.set_compute_mode, u, "ExclusiveProcess")
            if self.control is None:
                self._sim_record(d)
            else:
                await self._run(d)
            d.state = "ready"
            await self._write(d)
        except Exception as exc:
            log.warning("MPS daemon start failed; cleaning up", daemon=d.daemon_id, error=str(exc))
            try:
                await self._teardown(d)
            except Exception as cleanup:  # noqa: BLE001 - the record stays for the preparer's stop
                log.error("MPS daemon cleanup after a failed start failed; its record stays for a later stop",
                          daemon=d.daemon_id, error=str(cleanup))
            raise
        return d

    async def _run(self, d: MpsDaemonRecord) -> None:
        """The real daemon: `-d`, the limits over the control pipe, then a readiness query."""
        assert self.control is not None
        d.pid = await self.control.spawn(d)
        await self._write(d)
        if d.active_thread_percentage is not None:
            await self.control.command(d, f"set_default_active_thread_percentage {d.active_thread_percentage}")
        for uuid, limit in sorted(d.pinned_device_memory_limits.items()):
            await self.control.command(d, f"set_default_device_pinned_mem_limit {uuid} {max(1, limit >> 20)}M")
        answer = await self.control.command(d, READY_QUERY)
        with contextlib.suppress(ValueError, IndexError):
            got = float(answer.split()[0])
            if d.active_thread_percentage is not None and got != d.active_thread_percentage:
                raise ToolError("failed", f"MPS daemon {d.daemon_id} reports active thread percentage {answer!r}, "
                                          f"not the {d.active_thread_percentage} it was given")
        log.info("MPS daemon ready", daemon=d.daemon_id, pid=d.pid, gpus=d.gpu_uuids, ready_answer=answer)

    def _sim_record(self, d: MpsDaemonRecord | None, daemon_id: str = "") -> None:
        sim = self.nvml.sim()
        if sim is not None:  # the simulator converts to its own type
            sim.simMpsRecord(msgspec.to_builtins(d) if d is not None else None, daemon_id or (d.daemon_id if d else ""))

    async def _teardown(self, d: MpsDaemonRecord) -> bool:
        """Stop the daemon, reset compute modes, remove its dirs, then its record. True if it was running."""
        ran = await self.control.stop(d) if self.control is not None else False
        if self.control is None:
            self._sim_record(None, d.daemon_id)
        in_use = self._mode_users(d.daemon_id)  # another MIG device's daemon on the same GPU keeps its mode
        for u in d.mode_gpus or d.gpu_uuids:
            if u in in_use:
                continue
            try:
                await self.nvml.call(self.nvml.set_compute_mode, u, "Default")
            except NvmlOpError as exc:
                log.warning("compute mode reset failed", gpu=u, error=str(exc))
        base = self._dir(d.daemon_id)

        def remove() -> None:
            for sub in ("pipe", "shm", "log"):
                shutil.rmtree(base / sub, ignore_errors=True)
            (base / RECORD).unlink(missing_ok=True)
            shutil.rmtree(base, ignore_errors=True)

        await asyncio.to_thread(remove)
        self._records.pop(d.daemon_id, None)
        return ran

    async def stop(self, daemon_id: str) -> bool:
        """Stop a daemon and remove what it had; False when there was no record of it (idempotent)."""
        base = self._dir(daemon_id)
        d = self._records.get(daemon_id)
        if d is None:
            if await asyncio.to_thread(base.exists):  # interrupted before its record was written
                await asyncio.to_thread(shutil.rmtree, base, True)
            return False
        await self._teardown(d)
        return True

    async def reconcile(self) -> None:
        """At start: clean the records whose daemon is gone; remember the pid of those still running."""
        if self.control is None:
            return
        for d in list(self._records.values()):
            pid = await self.control.running_pid(d)
            if pid:
                if pid != d.pid:
                    d.pid = pid
                    await self._write(d)
                continue
            log.warning("MPS daemon of a record is gone (node reboot or discovery container restart); cleaning "
                        "its record and dirs, claims using it must be prepared again", daemon=d.daemon_id,
                        gpus=d.gpu_uuids, state=d.state)
            await self._teardown(d)
