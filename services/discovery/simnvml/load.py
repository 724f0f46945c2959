"""The simulated NVML's utilisation: SM %, memory in use, power and temperature, with pynvml's signatures.

A device is busy while a claim holds it (`simSetLoad`, fed by the node's claim lifecycle events:
services/discovery/simload.py), idle otherwise. The figures are a pure function of the device's UUID, whether
it is busy and the wall clock (slow sine waves with a per-device phase), so two samples a moment apart differ a
little, busy and idle never overlap, and a test can tell them apart without luck. As on real GPUs: in MIG
mode the GPU reports no SM %, and a MIG device gives only its memory.
"""

from __future__ import annotations

import math
import time
import zlib
from typing import Any

import pynvml as N

from services.discovery.simnvml.core import nvml_error
from services.discovery.simnvml.mig import SimMig

# board power limit per simulated product (W), from NVIDIA's data sheets (SXM parts)
TDP_W = {"a100-40gb": 400, "a100-80gb": 400, "h100": 700, "h200": 700, "b200": 1000, "gb200": 1200}
DEFAULT_TDP_W = 300  # L40S 350, T4 70: a plausible middle for the rest
IDLE_SM, BUSY_SM = 0, 80  # percent, before the wobble
IDLE_MEM, BUSY_MEM = 0.005, 0.65  # share of the framebuffer in use


def _wave(uuid: str, period_s: float, now: float) -> float:
    """-1..1, slow, with a phase of its own per device."""
    phase = (zlib.crc32(uuid.encode()) % 3600) / 3600 * 2 * math.pi
    return math.sin(now / period_s * 2 * math.pi + phase)


class SimLoad(SimMig):
    """Utilisation queries over the simulated devices; `simSetLoad` says which are busy."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._holders: dict[str, set[str]] = {}  # device UUID -> the claims holding it

    def simSetLoad(self, uuids: list[str], holder: str, busy: bool) -> None:
        with self._lock:
            for uuid in uuids:
                held = self._holders.setdefault(uuid, set())
                if busy:
                    held.add(holder)
                else:
                    held.discard(holder)
                    if not held:
                        del self._holders[uuid]

    def _busy(self, gpu_uuid: str, mig_uuids: list[str]) -> float:
        """0..1: a GPU held whole is 1; in MIG mode, the share of its MIG devices held."""
        if gpu_uuid in self._holders:
            return 1.0
        if not mig_uuids:
            return 0.0
        return sum(1 for u in mig_uuids if u in self._holders) / len(mig_uuids)

    def _load_of(self, handle: Any) -> tuple[str, float, bool]:
        """(UUID, busy 0..1, is a MIG device) of a GPU or MIG device handle."""
        with self._lock:
            mig = self._mig(handle)
            if mig is not None:
                return mig[2].uuid, (1.0 if mig[2].uuid in self._holders else 0.0), True
            gpu = self._gpu(handle)
            migs = [ci.uuid for gi in gpu.gis for ci in gi.cis] if gpu.mig_enabled else []
            return gpu.uuid, self._busy(gpu.uuid, migs), False

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        uuid, busy, is_mig = self._load_of(handle)
        if is_mig or self._gpu(handle).mig_enabled:
            raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
        now = time.time()
        sm = (BUSY_SM + 15 * _wave(uuid, 37, now) + 4 * _wave(uuid, 7, now)) if busy else IDLE_SM + _wave(uuid, 53, now)
        util = N.c_nvmlUtilization_t()
        util.gpu = max(0, min(100, round(sm)))
        util.memory = max(0, min(100, round(sm * 0.6)))
        return util

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        mem = super().nvmlDeviceGetMemoryInfo(handle, version)
        uuid, busy, _ = self._load_of(handle)
        share = IDLE_MEM + busy * (BUSY_MEM - IDLE_MEM + 0.08 * _wave(uuid, 91, time.time()))
        mem.used = int(mem.total * share) >> 20 << 20
        mem.free = mem.total - mem.used
        return mem

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        uuid, busy, is_mig = self._load_of(handle)
        if is_mig:
            raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
        tdp = TDP_W.get(self._gpu(handle).profile, DEFAULT_TDP_W)
        share = 0.1 + 0.01 * _wave(uuid, 29, time.time()) + busy * (0.65 + 0.1 * _wave(uuid, 41, time.time()))
        return round(tdp * share * 1000)  # milliwatts, as NVML reports it

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        uuid, busy, is_mig = self._load_of(handle)
        if is_mig or sensor != N.NVML_TEMPERATURE_GPU:
            raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
        return round(32 + 1.5 * _wave(uuid, 113, time.time()) + busy * (34 + 4 * _wave(uuid, 67, time.time())))
