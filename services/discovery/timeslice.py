"""Time-slice intervals of full GPUs: `nvidia-smi compute-policy -i <uuid> --set-timeslice <0..3>`, and
what each GPU holds now.

NVML has no call that reads the compute-policy time-slice back, and `nvidia-smi compute-policy
--list` prints a table whose format NVIDIA does not promise (nvidia-smi's output is documented as not
backwards compatible), so the value is never read from the GPU. Instead it is kept durably, one file
per GPU under `<state_dir>/timeslice/<uuid>.json`: the target is written as `pending` *before*
nvidia-smi runs and becomes `applied` once it succeeded. After a restart the inventory reports it
from there, never from memory. A `pending` value is reported as what the GPU may hold: a failed or
timed-out call may or may not have landed (the preparer resets from its own checkpoint either way).
Records from another boot are ignored: a reboot resets the policy to Default.

Under simulation without a driver root no binary runs: the simulated NVML holds the interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import msgspec

from services.discovery.nvml import TIMESLICES, Nvml, NvmlOpError
from shared.drivertools import DriverTools, ToolError
from shared.files import atomic_write, read_boot_id
from shared.logs import get_logger

log = get_logger(__name__)


class TimesliceRecord(msgspec.Struct, kw_only=True):
    """What one GPU's compute-policy time-slice is (0 Default .. 3 Long), as this node last set it."""

    uuid: str
    applied: int = 0  # the last value nvidia-smi confirmed
    pending: int | None = None  # a value being set, or whose call failed or timed out: it may be on the GPU
    boot_id: str = ""
    updated_at: float = 0.0

    @property
    def current(self) -> int:
        return self.pending if self.pending is not None else self.applied


class Timeslices:
    """Set a GPU's time-slice and report what every GPU holds."""

    def __init__(self, state_dir: Path, nvml: Nvml, tools: DriverTools | None):
        self.dir = Path(state_dir) / "timeslice"
        self.nvml = nvml
        self.tools = tools
        self.boot_id = ""
        self._records: dict[str, TimesliceRecord] = {}

    def _load_sync(self) -> dict[str, TimesliceRecord]:
        out: dict[str, TimesliceRecord] = {}
        if not self.dir.is_dir():
            return out
        for path in sorted(self.dir.glob("*.json")):
            try:
                rec = msgspec.json.decode(path.read_bytes(), type=TimesliceRecord)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("unreadable time-slice record ignored", path=str(path), error=str(exc))
                continue
            if rec.boot_id and self.boot_id and rec.boot_id != self.boot_id:
                continue  # written before a reboot, which reset the GPU's policy
            out[rec.uuid] = rec
        return out

    async def load(self) -> None:
        """Read the records (at start: the values survive a restart of this process)."""
        if self.tools is None:
            return
        self.boot_id = await asyncio.to_thread(read_boot_id)
        self._records = await asyncio.to_thread(self._load_sync)

    def current(self) -> dict[str, int] | None:
        """UUID -> the interval each GPU holds (0..3), from the records; None when the simulated NVML holds them."""
        if self.tools is None:
            return None
        return {uuid: rec.current for uuid, rec in self._records.items()}

    async def _write(self, rec: TimesliceRecord) -> None:
        rec.boot_id, rec.updated_at = self.boot_id, time.time()
        path = self.dir / f"{rec.uuid}.json"

        def write() -> None:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write(path, msgspec.json.encode(rec))

        await asyncio.to_thread(write)
        self._records[rec.uuid] = rec

    async def set(self, uuid: str, level: str) -> None:
        """Set the interval (`Default`, `Short`, `Medium`, `Long`) on one GPU; idempotent."""
        value = TIMESLICES[level]
        if self.tools is None:
            await self.nvml.call(self.nvml.set_timeslice, uuid, level)
            return
        if not uuid or "/" in uuid or uuid.startswith("."):
            raise NvmlOpError("invalid-argument", f"GPU UUID {uuid!r} is not a plain name")
        rec = self._records.get(uuid) or TimesliceRecord(uuid=uuid)
        rec = msgspec.structs.replace(rec, pending=value)
        await self._write(rec)  # before the call: a crash or timeout still shows what may be on the GPU
        args = ["compute-policy", "-i", uuid, "--set-timeslice", str(value)]
        result = await self.tools.run("nvidia-smi", args)
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip() or "no output"
            raise ToolError("failed", f"nvidia-smi {' '.join(args)} failed (exit {result.returncode}): {detail}")
        with contextlib.suppress(OSError):  # the call landed; a lost confirmation only keeps `pending`
            await self._write(msgspec.structs.replace(rec, applied=value, pending=None))
        log.info("time-slice set", gpu=uuid, timeslice=level, value=value)
