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
processes it started). While discovery runs, each running daemon is watched (a pidfd on the event
loop): one that exits without being asked to is started again with its record's settings, the same
pipe and shm dirs (its shares' containers reconnect there), at most MAX_REVIVALS times a minute; then
its record goes and the GPU is published without a daemon, so the next share's prepare asks for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Callable
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
MAX_REVIVALS = 3  # restarts of one daemon within REVIVAL_WINDOW_S before it is given up
REVIVAL_WINDOW_S = 60.0


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
        self._watches: dict[str, int] = {}  # daemon id -> pidfd of its running process
        self._revivals: dict[str, list[float]] = {}  # daemon id -> when it was started again
        self.on_exit: Callable[[str, int], None] | None = None  # (daemon id, pid): it exited unasked

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

    def by_gpu(self, *, ready_only: bool = False) -> dict[str, str]:
        """GPU (or MIG device) UUID -> the daemon serving it; `ready_only`: running ones (what is published)."""
        return {
            u: d.daemon_id for d in self._records.values() if not ready_only or d.state == "ready" for u in d.gpu_uuids
        }

    # ------------------------------------------------------------------ lifecycle
    def _mode_users(self, exclude: str) -> set[str]:
        """The physical GPUs other daemons keep in ExclusiveProcess."""
        return {g for d in self._records.values() if d.daemon_id != exclude for g in (d.mode_gpus or d.gpu_uuids)}

    async def start(
        self, req: MpsStartRequest, known_uuids: set[str], parents: dict[str, str] | None = None
    ) -> MpsDaemonRecord:
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
                and existing.pinned_device_memory_limits != dict(req.pinned_device_memory_limits)
            ):
                # one daemon serves many shares of a GPU: a start with other settings (limits named and
                # different, or another percentage) asks for another daemon, which the GPU cannot have
                raise NvmlOpError(
                    "in-use",
                    f"MPS daemon {req.daemon_id} already runs with other settings "
                    f"(active thread percentage {existing.active_thread_percentage}, "
                    f"pinned limits {existing.pinned_device_memory_limits})",
                )
            if existing.state == "ready" and (self.control is None or await self.control.running_pid(existing)):
                return existing
            log.info("MPS daemon record without a ready daemon; starting it again", daemon=req.daemon_id)
            await self._teardown(existing)
        taken = self.by_gpu()
        busy = [u for u in req.gpu_uuids if u in taken]
        if busy:
            raise NvmlOpError("in-use", f"GPUs {busy} are already served by MPS daemon {taken[busy[0]]}")
        d = MpsDaemonRecord(
            daemon_id=req.daemon_id,
            gpu_uuids=list(req.gpu_uuids),
            active_thread_percentage=req.active_thread_percentage,
            pinned_device_memory_limits=dict(req.pinned_device_memory_limits),
            mode_gpus=sorted({parents.get(u, u) for u in req.gpu_uuids}),
            pipe_dir=str(base / "pipe"),
            shm_dir=str(base / "shm"),
            log_dir=str(base / "log"),
            created_at=time.time(),
        )
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
            self._watch(d)
        except Exception as exc:
            log.warning("MPS daemon start failed; cleaning up", daemon=d.daemon_id, error=str(exc))
            try:
                await self._teardown(d)
            except Exception as cleanup:  # noqa: BLE001 - the record stays for the preparer's stop
                log.error(
                    "MPS daemon cleanup after a failed start failed; its record stays for a later stop",
                    daemon=d.daemon_id,
                    error=str(cleanup),
                )
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
                raise ToolError(
                    "failed",
                    f"MPS daemon {d.daemon_id} reports active thread percentage {answer!r}, "
                    f"not the {d.active_thread_percentage} it was given",
                )
        log.info("MPS daemon ready", daemon=d.daemon_id, pid=d.pid, gpus=d.gpu_uuids, ready_answer=answer)

    def _sim_record(self, d: MpsDaemonRecord | None, daemon_id: str = "") -> None:
        sim = self.nvml.sim()
        if sim is not None:  # the simulator converts to its own type
            sim.simMpsRecord(msgspec.to_builtins(d) if d is not None else None, daemon_id or (d.daemon_id if d else ""))

    # ------------------------------------------------------------------ exit watch
    def _watch(self, d: MpsDaemonRecord) -> None:
        """Have `on_exit` called when `d`'s process exits (a real daemon only)."""
        if self.control is None or not d.pid or d.daemon_id in self._watches:
            return
        try:
            fd = os.pidfd_open(d.pid)
        except OSError as exc:  # gone already, or a kernel without pidfds: the next start checks the pid
            log.warning("MPS daemon exit not watched", daemon=d.daemon_id, pid=d.pid, error=str(exc))
            return
        self._watches[d.daemon_id] = fd
        asyncio.get_running_loop().add_reader(fd, self._exited, d.daemon_id, d.pid)

    def _unwatch(self, daemon_id: str) -> None:
        fd = self._watches.pop(daemon_id, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _exited(self, daemon_id: str, pid: int) -> None:
        self._unwatch(daemon_id)
        if self.on_exit is not None:
            self.on_exit(daemon_id, pid)

    def close(self) -> None:
        """Stop watching (the daemons keep running: a restarted discovery finds them by their records)."""
        for daemon_id in list(self._watches):
            self._unwatch(daemon_id)

    async def revive(self, daemon_id: str, pid: int) -> bool:
        """After `on_exit`: start the daemon again if its record still wants it (not stopped since, not
        restarted since); give it up (record and dirs removed) past MAX_REVIVALS a minute or when its
        start fails. True when anything changed."""
        d = self._records.get(daemon_id)
        if d is None or d.pid != pid or d.state != "ready" or self.control is None:
            return False
        if await self.control.running_pid(d):
            self._watch(d)
            return False
        now = time.monotonic()
        recent = [t for t in self._revivals.get(daemon_id, []) if now - t < REVIVAL_WINDOW_S]
        if len(recent) >= MAX_REVIVALS:
            log.error(
                "MPS daemon keeps exiting; giving it up: its shares have no daemon until the next "
                "share's prepare starts one",
                daemon=daemon_id,
                pid=pid,
                revivals=len(recent),
            )
            await self._teardown(d)
            return True
        self._revivals[daemon_id] = [*recent, now]
        log.warning("MPS daemon exited unasked; starting it again", daemon=daemon_id, pid=pid, gpus=d.gpu_uuids)
        d.state = "starting"
        await self._write(d)
        try:
            await self._run(d)
        except Exception as exc:  # noqa: BLE001 - given up: published without a daemon
            log.error("MPS daemon could not be started again; giving it up", daemon=daemon_id, error=str(exc))
            await self._teardown(d)
            return True
        d.state = "ready"
        await self._write(d)
        self._watch(d)
        return True

    async def _teardown(self, d: MpsDaemonRecord) -> bool:
        """Stop the daemon, reset compute modes, remove its dirs, then its record. True if it was running."""
        self._unwatch(d.daemon_id)  # a stop asked for is no exit to answer
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
                self._watch(d)
                continue
            log.warning(
                "MPS daemon of a record is gone (node reboot or discovery container restart); cleaning "
                "its record and dirs, claims using it must be prepared again",
                daemon=d.daemon_id,
                gpus=d.gpu_uuids,
                state=d.state,
            )
            await self._teardown(d)
