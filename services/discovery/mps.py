"""MPS control daemons for sets of GPUs: pipe/shm/log dirs under the MPS root, limits, start and stop.

Owns the daemon records (`<mps_root>/<id>/daemon.json`). Under simulation no process is started:
the daemon is recorded in the simulated NVML state. On real nodes `nvidia-cuda-mps-control -d` runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import msgspec

from services.discovery.nvml import Nvml, NvmlOpError
from services.discovery.simnvml.state import SimMps
from shared.events.devices import MpsStartRequest


class MpsManager:
    def __init__(self, root: Path, nvml: Nvml):
        self.root = Path(root)
        self.nvml = nvml

    def _record_path(self, daemon_id: str) -> Path:
        if not daemon_id or "/" in daemon_id or daemon_id.startswith("."):
            raise NvmlOpError("invalid-argument", f"MPS daemon id {daemon_id!r} must be a plain name")
        return self.root / daemon_id / "daemon.json"

    def daemons(self) -> dict[str, SimMps]:
        out: dict[str, SimMps] = {}
        if not self.root.is_dir():
            return out
        for rec in self.root.glob("*/daemon.json"):
            try:
                d = msgspec.json.decode(rec.read_bytes(), type=SimMps)
            except (OSError, msgspec.DecodeError):
                continue
            out[d.daemon_id] = d
        return out

    def by_gpu(self) -> dict[str, str]:
        return {u: d.daemon_id for d in self.daemons().values() for u in d.gpu_uuids}

    def start(self, req: MpsStartRequest, known_uuids: set[str]) -> SimMps:
        """Runs on the NVML worker thread (it sets compute modes)."""
        rec_path = self._record_path(req.daemon_id)
        unknown = [u for u in req.gpu_uuids if u not in known_uuids]
        if unknown or not req.gpu_uuids:
            raise NvmlOpError("not-found", f"unknown GPU UUIDs for MPS: {unknown or 'none given'}")
        if req.active_thread_percentage is not None and not 1 <= req.active_thread_percentage <= 100:
            raise NvmlOpError("invalid-argument", "active_thread_percentage must be within 1..100")
        existing = self.daemons().get(req.daemon_id)
        if existing is not None:
            if sorted(existing.gpu_uuids) != sorted(req.gpu_uuids):
                raise NvmlOpError("invalid-argument", f"MPS daemon {req.daemon_id} already serves other GPUs")
            return existing
        taken = self.by_gpu()
        busy = [u for u in req.gpu_uuids if u in taken]
        if busy:
            raise NvmlOpError("in-use", f"GPUs {busy} are already served by MPS daemon {taken[busy[0]]}")
        base = rec_path.parent
        d = SimMps(daemon_id=req.daemon_id, gpu_uuids=list(req.gpu_uuids),
                   active_thread_percentage=req.active_thread_percentage,
                   pinned_device_memory_limits=dict(req.pinned_device_memory_limits),
                   pipe_dir=str(base / "pipe"), shm_dir=str(base / "shm"), log_dir=str(base / "log"))
        for p in (d.pipe_dir, d.shm_dir, d.log_dir):
            Path(p).mkdir(parents=True, exist_ok=True)
        for u in req.gpu_uuids:
            self.nvml.set_compute_mode(u, "ExclusiveProcess")
        sim = self.nvml.sim()
        if sim is not None:
            sim.simMpsRecord(d, d.daemon_id)
        else:
            self._spawn(d)
        (Path(d.log_dir) / "startup.log").write_text("startup complete\n")
        rec_path.write_bytes(msgspec.json.encode(d))
        return d

    def stop(self, daemon_id: str) -> bool:
        rec_path = self._record_path(daemon_id)
        d = self.daemons().get(daemon_id)
        if d is None:
            return False
        sim = self.nvml.sim()
        if sim is not None:
            sim.simMpsRecord(None, daemon_id)
        else:
            self._control(d, "quit")
        for u in d.gpu_uuids:
            try:
                self.nvml.set_compute_mode(u, "Default")
            except NvmlOpError:
                pass
        rec_path.unlink(missing_ok=True)
        shutil.rmtree(rec_path.parent, ignore_errors=True)
        return True

    # ------------------------------------------------------------------ real daemons
    def _env(self, d: SimMps) -> dict[str, str]:
        env = dict(os.environ)
        env.update(CUDA_VISIBLE_DEVICES=",".join(d.gpu_uuids), CUDA_MPS_PIPE_DIRECTORY=d.pipe_dir,
                   CUDA_MPS_LOG_DIRECTORY=d.log_dir)
        return env

    def _control(self, d: SimMps, command: str) -> None:
        exe = shutil.which("nvidia-cuda-mps-control")
        if exe is None:
            raise NvmlOpError("not-supported", "nvidia-cuda-mps-control not found on PATH")
        res = subprocess.run([exe], input=command + "\n", env=self._env(d), capture_output=True, text=True,
                             timeout=30, check=False)
        if res.returncode != 0:
            raise NvmlOpError("nvml-error", f"nvidia-cuda-mps-control {command!r}: {res.stderr.strip()}")

    def _spawn(self, d: SimMps) -> None:
        exe = shutil.which("nvidia-cuda-mps-control")
        if exe is None:
            raise NvmlOpError("not-supported", "nvidia-cuda-mps-control not found on PATH")
        res = subprocess.run([exe, "-d"], env=self._env(d), capture_output=True, text=True, timeout=30, check=False)
        if res.returncode != 0:
            raise NvmlOpError("nvml-error", f"starting the MPS control daemon: {res.stderr.strip()}")
        if d.active_thread_percentage is not None:
            self._control(d, f"set_default_active_thread_percentage {d.active_thread_percentage}")
        for uuid, limit in d.pinned_device_memory_limits.items():
            self._control(d, f"set_default_device_pinned_mem_limit {uuid} {max(1, limit >> 20)}M")
