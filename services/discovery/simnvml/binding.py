"""A simulated NVML with pynvml's call signatures, ctypes return structs and NVMLError codes.

Owns the simulated devices' behaviour (`SimCore`: state and device queries; `SimMig`: MIG; `SimLoad`:
utilisation) and, here, events and the extras that have no NVML call (time-slice, MPS bookkeeping, XID
injection): the `sim*` methods. Handles are real ctypes pointers with synthetic addresses (never
dereferenced), so code above treats them exactly like pynvml handles.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec
import pynvml as N

from services.discovery.simnvml import state as st
from services.discovery.simnvml.core import (
    KIND_GPU,
    KIND_MIG,
    KIND_SET,
    NO_ID,
    SUPPORTED_EVENTS,
    as_handle,
    decode_handle,
    gpu_uuid,
    handle_addr,
    nvml_error,
)
from services.discovery.simnvml.load import SimLoad

__all__ = ["SimNvml", "gpu_uuid"]


class SimNvml(SimLoad):
    """Module-like simulated NVML for one node. Thread-safe; every mutation is persisted."""

    # ------------------------------------------------------------------ events
    def nvmlEventSetCreate(self) -> Any:
        with self._lock:
            n = self._next_set
            self._next_set += 1
            self._sets[n] = {"regs": {}, "queue": deque()}
            return as_handle(N.c_nvmlEventSet_t, handle_addr(KIND_SET, n))

    def _set(self, event_set: Any) -> dict[str, Any]:
        kind, n, _, _ = decode_handle(event_set)
        if kind != KIND_SET or n not in self._sets:
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        return self._sets[n]

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._gpu(handle)
        return SUPPORTED_EVENTS

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        with self._lock:
            gpu = self._gpu(handle)
            if eventTypes & ~SUPPORTED_EVENTS:
                raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
            s = self._set(eventSet)
            s["regs"][gpu.index] = s["regs"].get(gpu.index, 0) | eventTypes

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        with self._cond:
            s = self._set(eventSet)
            if not s["queue"]:
                self._cond.wait_for(lambda: bool(s["queue"]) or s.get("freed", False), timeout=timeoutms / 1000)
            if s.get("freed") or not s["queue"]:
                raise nvml_error(N.NVML_ERROR_TIMEOUT)
            return s["queue"].popleft()

    nvmlEventSetWait_v2 = nvmlEventSetWait

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        with self._cond:
            _, n, _, _ = decode_handle(eventSet)
            s = self._sets.pop(n, None)
            if s is None:
                raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
            s["freed"] = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ simulation extras
    def simInjectEvent(self, uuid: str, event_type: int, data: int) -> int:
        """Deliver an NVML event for a GPU or MIG UUID to every event set registered for it.

        Returns the number of event sets it reached (0: nobody is listening).
        """
        with self._cond:
            handle = self.nvmlDeviceGetHandleByUUID(uuid)
            kind, index, gi, ci = decode_handle(handle)
            ev = N.c_nvmlEventData_t()
            ev.device = as_handle(N.c_nvmlDevice_t, handle_addr(KIND_GPU, index))
            ev.eventType = event_type
            ev.eventData = data
            ev.gpuInstanceId = gi if kind == KIND_MIG else NO_ID
            ev.computeInstanceId = ci if kind == KIND_MIG else NO_ID
            reached = 0
            for s in self._sets.values():
                if s["regs"].get(index, 0) & event_type:
                    s["queue"].append(ev)
                    reached += 1
            self._cond.notify_all()
            return reached

    def simGetTimeslice(self, handle: Any) -> int:
        return self._gpu(handle).timeslice

    def simSetTimeslice(self, handle: Any, level: int) -> None:
        with self._lock:
            gpu = self._gpu(handle)
            if not 0 <= level <= 3:
                raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
            if gpu.timeslice != level:
                gpu.timeslice = level
                self._persist()

    def simMpsRecord(self, daemon: dict[str, Any] | None, daemon_id: str) -> None:
        """Keep (or drop, with None) a copy of discovery's MPS daemon record, given as plain data."""
        with self._lock:
            if daemon is None:
                self.state.mps.pop(daemon_id, None)
            else:
                self.state.mps[daemon_id] = msgspec.convert(daemon, st.SimMps)
            self._persist()

    def simMpsDaemons(self) -> dict[str, st.SimMps]:
        with self._lock:
            return dict(self.state.mps)
