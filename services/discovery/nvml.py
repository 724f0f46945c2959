"""The NVML access layer: the only caller of either binding (real `pynvml` or the simulated NVML).

Owns loading libnvidia-ml (system or `--driver-root`), one worker thread for all NVML calls
(NVML handles are process-global), and typed facts read from NVML. Code above never sees a handle.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import threading
import uuid as uuidlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pynvml as N

from shared.driverroot import DriverRoot, DriverRootError

T = TypeVar("T")

LIB_NAME = "libnvidia-ml.so.1"
NO_ID = 0xFFFFFFFF
HEALTH_EVENTS = N.nvmlEventTypeXidCriticalError | N.nvmlEventTypeDoubleBitEccError | N.nvmlEventTypeSingleBitEccError
_GPU_LOST_EVENT = getattr(N, "nvmlEventTypeGpuUnavailableError", 0)
_CI_INDEX_FOR_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}
COMPUTE_MODES = {
    "Default": N.NVML_COMPUTEMODE_DEFAULT,
    "ExclusiveProcess": N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    "Prohibited": N.NVML_COMPUTEMODE_PROHIBITED,
}
TIMESLICES = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or initialised; the message says what to check."""


class NvmlOpError(RuntimeError):
    """A device operation was refused; `code` is the DeviceOpError code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class GpuLost(RuntimeError):
    """NVML reported GPU_IS_LOST while waiting for events."""


@dataclass
class ProfileFacts:
    name: str
    gi_profile_id: int
    ci_profile_id: int
    slices: int
    memory_mib: int
    sms: int
    ce: int
    dec: int
    enc: int
    jpeg: int
    ofa: int
    placements: list[tuple[int, int]]


@dataclass
class MigFacts:
    uuid: str
    gi_id: int
    ci_id: int
    gi_profile_id: int
    start: int
    size: int


@dataclass
class FabricFacts:
    cluster_uuid: str
    clique_id: int
    state: int
    status: int


@dataclass
class GpuFacts:
    index: int
    minor: int
    uuid: str
    name: str
    brand: int
    architecture: int
    cc: tuple[int, int]
    memory_total: int | None
    bus_id: str  # as NVML reports it, e.g. 00000000:3B:00.0
    pci_device_id: int
    numa_node: int | None
    addressing_mode: int | None
    mig_capable: bool
    mig_enabled: bool
    compute_mode: int | None
    timeslice: int | None
    profiles: list[ProfileFacts] = field(default_factory=list)
    mig: list[MigFacts] = field(default_factory=list)
    fabric: FabricFacts | None = None
    module_id: int | None = None  # the HGX baseboard module id (Fabric Manager's physical id)


@dataclass
class NodeFacts:
    driver_version: str
    cuda_version: int
    gpus: list[GpuFacts]


@dataclass
class SampleFacts:
    """One device's utilisation; None where NVML does not give the figure for it."""

    uuid: str
    sm_percent: int | None
    memory_used: int | None
    memory_total: int | None
    power_mw: int | None
    temperature_c: int | None


@dataclass
class RawEvent:
    gpu_uuid: str
    event_type: int
    data: int
    gi_id: int
    ci_id: int

    @property
    def is_xid(self) -> bool:
        return bool(self.event_type & N.nvmlEventTypeXidCriticalError)

    @property
    def is_gpu_lost(self) -> bool:
        return bool(_GPU_LOST_EVENT and self.event_type & _GPU_LOST_EVENT)


def find_library(driver_root: str | Path) -> Path:
    """libnvidia-ml.so.1 under a driver root as this process sees it (through the root's ld cache, else the
    standard library dirs), or NvmlUnavailable saying where it looked."""
    root = DriverRoot.of(str(driver_root))
    try:
        return root.local(root.nvml_library())
    except DriverRootError as exc:
        raise NvmlUnavailable(f"{exc}; or use --simulate") from None


def load_real_binding(driver_root: str | None) -> Any:
    """The pynvml module, bound to the system library or the one under `driver_root`."""
    if driver_root and N.nvmlLib is None:
        lib = find_library(driver_root)
        with N.libLoadLock:
            try:
                N.nvmlLib = ctypes.CDLL(str(lib))
            except OSError as exc:
                raise NvmlUnavailable(f"cannot load {lib}: {exc}") from exc
    return N


def _errcode(exc: BaseException) -> int:
    return int(getattr(exc, "value", N.NVML_ERROR_UNKNOWN))


def _opt(fn: Any, *args: Any) -> Any:
    """Call an optional NVML function: None when unsupported, missing or failing."""
    try:
        return fn(*args)
    except (N.NVMLError, AttributeError, NotImplementedError):
        return None


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """One NVML session. Sync methods run on the worker thread via `call`; `wait_event` has its own."""

    def __init__(self, binding: Any):
        self._b = binding
        self.simulated = bool(getattr(binding, "is_simulated", False))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")
        self._handles: dict[str, Any] = {}
        self._auto_mig: set[str] = set()
        self._lock = threading.Lock()
        self._open = False

    # ------------------------------------------------------------------ lifecycle
    async def call(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on the NVML worker thread (never on the event loop)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    def init(self) -> None:
        try:
            self._b.nvmlInit()
        except N.NVMLError as exc:
            code = _errcode(exc)
            hint = {
                N.NVML_ERROR_LIBRARY_NOT_FOUND: f"{LIB_NAME} was not found: install the NVIDIA driver, pass "
                "--driver-root DIR, or run with --simulate SPEC",
                N.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded on this node",
                N.NVML_ERROR_NO_PERMISSION: "no permission to open /dev/nvidia*: run privileged",
                N.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "libnvidia-ml and the kernel driver differ: "
                "reboot or reload the driver",
            }.get(code, "check the driver installation")
            raise NvmlUnavailable(f"NVML init failed ({exc}): {hint}") from exc
        self._open = True

    def shutdown(self) -> None:
        if self._open:
            self._open = False
            try:
                self._b.nvmlShutdown()
            except N.NVMLError:
                pass

    async def start(self) -> None:
        await self.call(self.init)

    async def close(self) -> None:
        await self.call(self.shutdown)
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ reads
    def read(self) -> NodeFacts:
        """Everything discovery reports, as plain facts."""
        b = self._b
        gpus = []
        handles: dict[str, Any] = {}
        for i in range(b.nvmlDeviceGetCount()):
            h = b.nvmlDeviceGetHandleByIndex(i)
            g = self._read_gpu(i, h)
            handles[g.uuid] = h
            gpus.append(g)
        with self._lock:
            self._handles = handles
        return NodeFacts(_s(b.nvmlSystemGetDriverVersion()), int(b.nvmlSystemGetCudaDriverVersion()), gpus)

    def _read_gpu(self, index: int, h: Any) -> GpuFacts:
        b = self._b
        uuid = _s(b.nvmlDeviceGetUUID(h))
        mem = _opt(b.nvmlDeviceGetMemoryInfo, h)
        pci = b.nvmlDeviceGetPciInfo(h)
        mig_mode = _opt(b.nvmlDeviceGetMigMode, h)
        addressing = _opt(b.nvmlDeviceGetAddressingMode, h)
        g = GpuFacts(
            index=index,
            minor=int(b.nvmlDeviceGetMinorNumber(h)),
            uuid=uuid,
            name=_s(b.nvmlDeviceGetName(h)),
            brand=int(_opt(b.nvmlDeviceGetBrand, h) or 0),
            architecture=int(b.nvmlDeviceGetArchitecture(h)),
            cc=tuple(b.nvmlDeviceGetCudaComputeCapability(h)),
            memory_total=int(mem.total) if mem is not None else None,
            bus_id=_s(pci.busId),
            pci_device_id=int(pci.pciDeviceId),
            numa_node=_opt(b.nvmlDeviceGetNumaNodeId, h),
            addressing_mode=int(getattr(addressing, "value", addressing)) if addressing is not None else None,
            mig_capable=mig_mode is not None,
            mig_enabled=bool(mig_mode and mig_mode[0] == N.NVML_DEVICE_MIG_ENABLE),
            compute_mode=_opt(b.nvmlDeviceGetComputeMode, h),
            timeslice=self._read_timeslice(h),
            module_id=_opt(b.nvmlDeviceGetModuleId, h),
        )
        if g.mig_capable:
            g.profiles = self._read_profiles(h)
            if g.mig_enabled:
                g.mig = self._read_mig(h)
        g.fabric = self._read_fabric(h)
        return g

    def _read_timeslice(self, h: Any) -> int | None:
        """The simulated interval; None on real NVML, which cannot read it (services.discovery.timeslice)."""
        getter = getattr(self._b, "simGetTimeslice", None)
        return int(getter(h)) if getter is not None else None

    def _read_profiles(self, h: Any) -> list[ProfileFacts]:
        b = self._b
        out: list[ProfileFacts] = []
        for idx in range(N.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = b.nvmlDeviceGetGpuInstanceProfileInfo(h, idx)
            except N.NVMLError as exc:
                if _errcode(exc) not in (N.NVML_ERROR_NOT_SUPPORTED, N.NVML_ERROR_INVALID_ARGUMENT):
                    raise
                continue
            if info.instanceCount == 0:
                continue
            name = _s(getattr(info, "name", b"")).removeprefix("MIG ").strip()
            if not name:
                name = f"{info.sliceCount}g.{math.ceil(info.memorySizeMB / 1024)}gb"
            placements = self._placements(h, info.id, info.instanceCount)
            out.append(
                ProfileFacts(
                    name=name,
                    gi_profile_id=int(info.id),
                    ci_profile_id=_CI_INDEX_FOR_SLICES.get(int(info.sliceCount), 0),
                    slices=int(info.sliceCount),
                    memory_mib=int(info.memorySizeMB),
                    sms=int(info.multiprocessorCount),
                    ce=int(info.copyEngineCount),
                    dec=int(info.decoderCount),
                    enc=int(info.encoderCount),
                    jpeg=int(info.jpegCount),
                    ofa=int(info.ofaCount),
                    placements=placements,
                )
            )
        out.sort(key=lambda p: (p.slices, p.memory_mib, p.name))
        return out

    def _placements(self, h: Any, profile_id: int, hint: int) -> list[tuple[int, int]]:
        size = max(hint, 8)
        arr = (N.c_nvmlGpuInstancePlacement_t * size)()
        count = ctypes.c_uint(size)
        try:
            self._b.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ctypes.byref(count))
        except N.NVMLError as exc:
            if _errcode(exc) in (N.NVML_ERROR_NOT_SUPPORTED, N.NVML_ERROR_INVALID_ARGUMENT):
                return []
            raise
        return [(int(arr[i].start), int(arr[i].size)) for i in range(count.value)]

    def _read_mig(self, h: Any) -> list[MigFacts]:
        b = self._b
        out: list[MigFacts] = []
        for i in range(int(b.nvmlDeviceGetMaxMigDeviceCount(h))):
            try:
                m = b.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except N.NVMLError as exc:
                if _errcode(exc) in (N.NVML_ERROR_NOT_FOUND, N.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise
            gi_id = int(b.nvmlDeviceGetGpuInstanceId(m))
            ci_id = int(b.nvmlDeviceGetComputeInstanceId(m))
            gi = b.nvmlDeviceGetGpuInstanceById(h, gi_id)
            info = b.nvmlGpuInstanceGetInfo(gi)
            out.append(
                MigFacts(
                    _s(b.nvmlDeviceGetUUID(m)),
                    gi_id,
                    ci_id,
                    int(info.profileId),
                    int(info.placement.start),
                    int(info.placement.size),
                )
            )
        return out

    def _read_fabric(self, h: Any) -> FabricFacts | None:
        b = self._b
        if int(b.nvmlDeviceGetArchitecture(h)) < N.NVML_DEVICE_ARCH_HOPPER:
            return None
        info = N.c_nvmlGpuFabricInfoV_t()
        try:
            b.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
        except (N.NVMLError, AttributeError):
            return None
        if info.state == N.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
            return None
        raw = bytes(info.clusterUuid)
        if not any(raw):
            return None
        return FabricFacts(str(uuidlib.UUID(bytes=raw)), int(info.cliqueId), int(info.state), int(info.status))

    # ------------------------------------------------------------------ utilisation
    def sample(self, uuids: list[str]) -> list[SampleFacts]:
        """SM %, memory, power and temperature of each device (GPU or MIG UUID) that NVML still knows."""
        b = self._b
        out: list[SampleFacts] = []
        for uuid in uuids:
            try:
                h = self._handle(uuid)
            except NvmlOpError:
                continue
            util = _opt(b.nvmlDeviceGetUtilizationRates, h)
            mem = _opt(b.nvmlDeviceGetMemoryInfo, h)
            power = _opt(b.nvmlDeviceGetPowerUsage, h)
            temp = _opt(b.nvmlDeviceGetTemperature, h, N.NVML_TEMPERATURE_GPU)
            out.append(
                SampleFacts(
                    uuid,
                    int(util.gpu) if util is not None else None,
                    int(mem.used) if mem is not None else None,
                    int(mem.total) if mem is not None else None,
                    int(power) if power is not None else None,
                    int(temp) if temp is not None else None,
                )
            )
        return out

    def set_load(self, uuids: list[str], holder: str, busy: bool) -> bool:
        """Simulation only: mark devices busy (or idle again) for `holder`. False on real NVML."""
        setter = getattr(self._b, "simSetLoad", None)
        if setter is None:
            return False
        setter(uuids, holder, busy)
        return True

    # ------------------------------------------------------------------ operations
    def _handle(self, uuid: str) -> Any:
        with self._lock:
            h = self._handles.get(uuid)
        if h is None:
            try:
                h = self._b.nvmlDeviceGetHandleByUUID(uuid)
            except N.NVMLError as exc:
                raise NvmlOpError("not-found", f"no GPU with UUID {uuid} on this node") from exc
            with self._lock:
                self._handles[uuid] = h
        return h

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        h = self._handle(uuid)
        try:
            if self._b.nvmlDeviceGetComputeMode(h) != COMPUTE_MODES[mode]:
                self._b.nvmlDeviceSetComputeMode(h, COMPUTE_MODES[mode])
        except N.NVMLError as exc:
            raise NvmlOpError("nvml-error", f"setting compute mode {mode} on {uuid}: {exc}") from exc

    def set_timeslice(self, uuid: str, level: str) -> None:
        """Simulated NVML only: real GPUs get theirs from nvidia-smi (services.discovery.timeslice)."""
        setter = getattr(self._b, "simSetTimeslice", None)
        if setter is None:
            raise NvmlOpError(
                "not-supported",
                "NVML cannot set the compute time-slice; it is set with nvidia-smi from the driver root",
            )
        setter(self._handle(uuid), TIMESLICES[level])

    def create_mig(self, gpu_uuid: str, gi_profile_id: int, start: int) -> tuple[MigFacts, bool]:
        """Create (or find) the MIG device with a GI profile at a placement start. Returns (device, created)."""
        b = self._b
        h = self._handle(gpu_uuid)
        mode = _opt(b.nvmlDeviceGetMigMode, h)
        if mode is None:
            raise NvmlOpError("not-supported", f"GPU {gpu_uuid} is not MIG-capable")
        profiles = {p.gi_profile_id: p for p in self._read_profiles(h)}
        prof = profiles.get(gi_profile_id)
        if prof is None:
            raise NvmlOpError("invalid-argument", f"GPU {gpu_uuid} has no GI profile id {gi_profile_id}")
        size = next((sz for st, sz in prof.placements if st == start), None)
        if size is None:
            raise NvmlOpError(
                "invalid-argument",
                f"placement start {start} is not valid for {prof.name}; "
                f"valid starts: {[s for s, _ in prof.placements]}",
            )
        if mode[0] != N.NVML_DEVICE_MIG_ENABLE:
            if int(b.nvmlDeviceGetArchitecture(h)) < N.NVML_DEVICE_ARCH_HOPPER:
                raise NvmlOpError(
                    "mig-disabled",
                    f"MIG mode is off on {gpu_uuid}; Ampere GPUs need an admin "
                    "to enable it (a GPU reset), discovery does not toggle it",
                )
            try:
                b.nvmlDeviceSetMigMode(h, N.NVML_DEVICE_MIG_ENABLE)
            except N.NVMLError as exc:
                raise NvmlOpError("nvml-error", f"enabling MIG mode on {gpu_uuid}: {exc}") from exc
            self._auto_mig.add(gpu_uuid)
        live = self._read_mig(h)
        for m in live:
            if m.gi_profile_id == gi_profile_id and m.start == start:
                return m, False
        for m in live:
            if m.start < start + size and start < m.start + m.size:
                raise NvmlOpError(
                    "placement-overlap",
                    f"placement {start}+{size} of {prof.name} overlaps live MIG device {m.uuid} at {m.start}+{m.size}",
                )
        placement = N.c_nvmlGpuInstancePlacement_t()
        placement.start = start
        placement.size = size
        try:
            gi = b.nvmlDeviceCreateGpuInstanceWithPlacement(h, gi_profile_id, ctypes.byref(placement))
        except N.NVMLError as exc:
            code = "placement-overlap" if _errcode(exc) == N.NVML_ERROR_INSUFFICIENT_RESOURCES else "nvml-error"
            raise NvmlOpError(code, f"creating {prof.name} at {start} on {gpu_uuid}: {exc}") from exc
        try:
            ci_info = b.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, prof.ci_profile_id, N.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
            ci = b.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
            info = b.nvmlComputeInstanceGetInfo(ci)
            mig_uuid = _s(b.nvmlDeviceGetUUID(info.device))
            gi_info = b.nvmlGpuInstanceGetInfo(gi)
        except N.NVMLError as exc:
            _opt(b.nvmlGpuInstanceDestroy, gi)
            raise NvmlOpError(
                "nvml-error", f"creating the compute instance of {prof.name} on {gpu_uuid}: {exc}"
            ) from exc
        return MigFacts(mig_uuid, int(gi_info.id), int(info.id), gi_profile_id, start, size), True

    def destroy_mig(self, gpu_uuid: str, mig_uuid: str) -> bool:
        """Destroy a MIG device; False when it did not exist (idempotent)."""
        b = self._b
        h = self._handle(gpu_uuid)
        mode = _opt(b.nvmlDeviceGetMigMode, h)
        if mode is None or mode[0] != N.NVML_DEVICE_MIG_ENABLE:
            return False
        live = self._read_mig(h)
        target = next((m for m in live if m.uuid == mig_uuid), None)
        if target is None:
            return False
        try:
            gi = b.nvmlDeviceGetGpuInstanceById(h, target.gi_id)
            try:
                ci = b.nvmlGpuInstanceGetComputeInstanceById(gi, target.ci_id)
                b.nvmlComputeInstanceDestroy(ci)
            except N.NVMLError as exc:
                if _errcode(exc) != N.NVML_ERROR_NOT_FOUND:
                    raise
            b.nvmlGpuInstanceDestroy(gi)
        except N.NVMLError as exc:
            if _errcode(exc) == N.NVML_ERROR_NOT_FOUND:
                return False
            code = "in-use" if _errcode(exc) == N.NVML_ERROR_IN_USE else "nvml-error"
            raise NvmlOpError(code, f"destroying MIG device {mig_uuid}: {exc}") from exc
        if len(live) == 1 and gpu_uuid in self._auto_mig:
            if _opt(b.nvmlDeviceSetMigMode, h, N.NVML_DEVICE_MIG_DISABLE) is not None:
                self._auto_mig.discard(gpu_uuid)
        return True

    # ------------------------------------------------------------------ events
    def open_events(self) -> tuple[Any, list[str]]:
        """An event set with XID/ECC (and GPU-lost where supported) registered on every GPU.

        Returns (event set, UUIDs that could not be monitored).
        """
        b = self._b
        es = b.nvmlEventSetCreate()
        unmonitored: list[str] = []
        for i in range(b.nvmlDeviceGetCount()):
            h = b.nvmlDeviceGetHandleByIndex(i)
            uuid = _s(b.nvmlDeviceGetUUID(h))
            try:
                supported = int(b.nvmlDeviceGetSupportedEventTypes(h))
                mask = supported & (HEALTH_EVENTS | _GPU_LOST_EVENT)
                if not mask:
                    unmonitored.append(uuid)
                    continue
                b.nvmlDeviceRegisterEvents(h, mask, es)
            except N.NVMLError:
                unmonitored.append(uuid)
        return es, unmonitored

    def wait_event(self, es: Any, timeout_ms: int) -> RawEvent | None:
        """Block up to timeout for one event (call from a dedicated thread, not the worker)."""
        b = self._b
        try:
            ev = b.nvmlEventSetWait(es, timeout_ms)
        except N.NVMLError as exc:
            code = _errcode(exc)
            if code == N.NVML_ERROR_TIMEOUT:
                return None
            if code == N.NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(str(exc)) from exc
            raise
        try:
            uuid = _s(b.nvmlDeviceGetUUID(ev.device))
        except N.NVMLError as exc:
            raise GpuLost(f"event for an unknown device: {exc}") from exc
        return RawEvent(uuid, int(ev.eventType), int(ev.eventData), int(ev.gpuInstanceId), int(ev.computeInstanceId))

    def close_events(self, es: Any) -> None:
        _opt(self._b.nvmlEventSetFree, es)

    def inject_event(self, uuid: str, xid: int, gpu_lost: bool) -> int | None:
        """Simulation only: raise an XID or GPU-lost event. None when the binding is real NVML."""
        inject = getattr(self._b, "simInjectEvent", None)
        if inject is None:
            return None
        kind = (_GPU_LOST_EVENT or N.nvmlEventTypeXidCriticalError) if gpu_lost else N.nvmlEventTypeXidCriticalError
        try:
            return int(inject(uuid, kind, xid))
        except N.NVMLError as exc:
            raise NvmlOpError("not-found", f"no device with UUID {uuid} on this node") from exc

    # ------------------------------------------------------------------ simulation bookkeeping
    def sim(self) -> Any:
        """The simulated binding (for MPS bookkeeping), or None on real NVML."""
        return self._b if self.simulated else None
