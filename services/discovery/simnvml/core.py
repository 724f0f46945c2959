"""The simulated NVML's core: handles, the node's simulated state (built, loaded, persisted), init and the
plain device queries. MIG calls are `simnvml.mig`'s, events and the `sim*` extras `simnvml.binding`'s."""

from __future__ import annotations

import ctypes
import threading
import uuid as uuidlib
from pathlib import Path
from typing import Any

import pynvml as N

from services.discovery import devtree, profiles, simpci
from services.discovery.machine import MachineSpec
from services.discovery.simnvml import state as st

SUCCESS: int = N.NVML_SUCCESS

_NS = uuidlib.UUID("5b0f3a5e-7c1d-4e8a-9d2b-6a4c3e1f0b7d")
_BASE = 0x7F00_0000_0000
KIND_GPU, KIND_GI, KIND_CI, KIND_MIG, KIND_SET = 1, 2, 3, 4, 5
CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}  # NVML_COMPUTE_INSTANCE_PROFILE_* -> slices
NO_ID = 0xFFFFFFFF
SUPPORTED_EVENTS: int = (
    N.nvmlEventTypeXidCriticalError
    | N.nvmlEventTypeDoubleBitEccError
    | N.nvmlEventTypeSingleBitEccError
    | N.nvmlEventTypeGpuUnavailableError
)


def nvml_error(code: int) -> N.NVMLError:
    return N.NVMLError(code)


def handle_addr(kind: int, index: int = 0, gi: int = 0, ci: int = 0) -> int:
    return _BASE | (kind << 32) | (index << 16) | (gi << 8) | ci


def as_handle(ctype: Any, addr: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(addr), ctype)


def decode_handle(handle: Any) -> tuple[int, int, int, int]:
    try:
        addr = ctypes.cast(handle, ctypes.c_void_p).value or 0
    except (TypeError, ctypes.ArgumentError):
        raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT) from None
    if addr & ~0xFFFF_FFFF_FFFF != 0 or (addr & _BASE) != _BASE:
        raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
    return (addr >> 32) & 0xFF, (addr >> 16) & 0xFFFF, (addr >> 8) & 0xFF, addr & 0xFF


def out_of(ref: Any) -> Any:
    """The object behind `byref(x)`, `pointer(x)` or `x` itself (how pynvml callers pass outputs)."""
    obj = getattr(ref, "_obj", None)  # byref's argument object: ctypes names no public accessor for it
    if obj is not None:
        return obj
    if hasattr(type(ref), "contents"):  # a pointer type's instance
        return ref.contents
    return ref


def gpu_uuid(node: str, index: int) -> str:
    return f"GPU-{uuidlib.uuid5(_NS, f'{node}/gpu/{index}')}"


class SimCore:
    """Module-like simulated NVML for one node. Thread-safe; every mutation is persisted."""

    is_simulated = True

    def __init__(self, node: str, machine: MachineSpec, state_file: Path, dev_root: Path | None = None):
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._node = node
        self._state_file = Path(state_file)
        self._dev_root = Path(dev_root) if dev_root else None
        self._inits = 0
        self._sets: dict[int, dict[str, Any]] = {}
        self._next_set = 1
        fp = machine.fingerprint()
        loaded = st.load(self._state_file)
        if loaded is not None and loaded.node == node and loaded.machine == fp:
            self.state = loaded
        else:
            self.state = self._build(node, machine, fp)
        self._persist()

    # ------------------------------------------------------------------ construction
    def _build(self, node: str, machine: MachineSpec, fp: str) -> st.SimState:
        gpus: list[st.SimGpu] = []
        used_bus: set[str] = set()
        per_profile: dict[str, int] = {}
        specs = machine.expanded()
        first = profiles.lookup(specs[0].profile)
        for i, g in enumerate(specs):
            prof = profiles.lookup(g.profile)
            k = per_profile.get(prof.key, 0)
            per_profile[prof.key] = k + 1
            bus = prof.bus_ids[k] if k < len(prof.bus_ids) else ""
            if not bus or bus.lower() in used_bus:
                bus = f"0000:{(0xC0 + i) & 0xFF:02X}:00.0"
            root, numa = prof.root_of(bus)
            used_bus.add(bus.lower())
            cluster = g.fabric.cluster_uuid if g.fabric else profiles.DEFAULT_CLUSTER_UUID
            clique = (
                g.clique_id
                if g.clique_id is not None
                else (g.fabric.clique_id if g.fabric else profiles.DEFAULT_CLIQUE_ID)
            )
            gpus.append(
                st.SimGpu(
                    index=i,
                    profile=prof.key,
                    uuid=gpu_uuid(node, i),
                    minor=i,
                    bus_id=bus.lower(),
                    pcie_root=root,
                    numa_node=numa,
                    mig_enabled=g.mig_enabled,
                    fabric_cluster_uuid=cluster if prof.fabric else "",
                    fabric_clique_id=clique if prof.fabric else 0,
                )
            )
        cuda = first.cuda_version
        if machine.cuda_version:
            major, minor = machine.cuda_version.split(".")
            cuda = int(major) * 1000 + int(minor) * 10
        state = st.SimState(
            node=node,
            machine=fp,
            driver_version=machine.driver_version or first.driver_version,
            cuda_version=cuda,
            gpus=gpus,
        )
        self.state = state
        for gpu, g in zip(gpus, specs, strict=True):
            prof = profiles.lookup(g.profile)
            for dev in g.mig_devices:
                mp = next(m for m in prof.mig if m.name == dev.profile)
                gi = self._create_gi(gpu, mp, dev.placement, mp.size)
                self._create_ci(gpu, gi, ci_index_for(mp.slices))
        return state

    def _persist(self) -> None:
        st.save(self._state_file, self.state)
        if self._dev_root is not None:
            simpci.serve(self._dev_root)  # the node's PCI binds and unbinds (VFIO passthrough)
            devtree.sync(
                self._dev_root,
                [
                    devtree.DevGpu(
                        g.minor, g.bus_id, g.pcie_root, g.numa_node, [(gi.id, ci.id) for gi in g.gis for ci in gi.cis]
                    )
                    for g in self.state.gpus
                ],
            )

    # ------------------------------------------------------------------ lookups
    def _gpu(self, handle: Any, allow_mig: bool = False) -> st.SimGpu:
        kind, index, _, _ = decode_handle(handle)
        if kind not in (KIND_GPU, KIND_MIG) or (kind == KIND_MIG and not allow_mig):
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(self.state.gpus):
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        return self.state.gpus[index]

    def _mig(self, handle: Any) -> tuple[st.SimGpu, st.SimGi, st.SimCi] | None:
        kind, index, gi_id, ci_id = decode_handle(handle)
        if kind != KIND_MIG:
            return None
        gpu = self._gpu(as_handle(N.c_nvmlDevice_t, handle_addr(KIND_GPU, index)))
        gi = self._find_gi(gpu, gi_id)
        ci = next((c for c in gi.cis if c.id == ci_id), None)
        if ci is None:
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        return gpu, gi, ci

    def _gi_of(self, handle: Any) -> tuple[st.SimGpu, st.SimGi]:
        kind, index, gi_id, _ = decode_handle(handle)
        if kind != KIND_GI or index >= len(self.state.gpus):
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.state.gpus[index]
        return gpu, self._find_gi(gpu, gi_id)

    def _ci_of(self, handle: Any) -> tuple[st.SimGpu, st.SimGi, st.SimCi]:
        kind, index, gi_id, ci_id = decode_handle(handle)
        if kind != KIND_CI or index >= len(self.state.gpus):
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.state.gpus[index]
        gi = self._find_gi(gpu, gi_id)
        ci = next((c for c in gi.cis if c.id == ci_id), None)
        if ci is None:
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        return gpu, gi, ci

    @staticmethod
    def _find_gi(gpu: st.SimGpu, gi_id: int) -> st.SimGi:
        gi = next((g for g in gpu.gis if g.id == gi_id), None)
        if gi is None:
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        return gi

    @staticmethod
    def _profile(gpu: st.SimGpu) -> profiles.GpuProfile:
        return profiles.PROFILES[gpu.profile]

    def _mig_spec_by_id(self, gpu: st.SimGpu, gi_profile_id: int) -> profiles.MigProfileSpec:
        spec = next((m for m in self._profile(gpu).mig if m.gi_profile_id == gi_profile_id), None)
        if spec is None:
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        return spec

    def _mig_spec_by_index(self, gpu: st.SimGpu, index: int) -> profiles.MigProfileSpec:
        spec = next((m for m in self._profile(gpu).mig if m.profile_index == index), None)
        if spec is None:
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        return spec

    def _require_mig_capable(self, gpu: st.SimGpu) -> None:
        if not self._profile(gpu).mig_capable:
            raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)

    # ------------------------------------------------------------------ init / system
    def nvmlInit(self) -> None:
        with self._lock:
            self._inits += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.nvmlInit()

    def nvmlShutdown(self) -> None:
        with self._lock:
            if self._inits == 0:
                raise nvml_error(N.NVML_ERROR_UNINITIALIZED)
            self._inits -= 1

    def _check_init(self) -> None:
        if self._inits == 0:
            raise nvml_error(N.NVML_ERROR_UNINITIALIZED)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return self.state.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check_init()
        return self.state.cuda_version

    nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self.state.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._check_init()
        if not 0 <= index < len(self.state.gpus):
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        return as_handle(N.c_nvmlDevice_t, handle_addr(KIND_GPU, index))

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        self._check_init()
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        with self._lock:
            for g in self.state.gpus:
                if g.uuid == text:
                    return as_handle(N.c_nvmlDevice_t, handle_addr(KIND_GPU, g.index))
                for gi in g.gis:
                    for ci in gi.cis:
                        if ci.uuid == text:
                            return as_handle(N.c_nvmlDevice_t, handle_addr(KIND_MIG, g.index, gi.id, ci.id))
        raise nvml_error(N.NVML_ERROR_NOT_FOUND)

    # ------------------------------------------------------------------ device identity
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        with self._lock:
            mig = self._mig(handle)
            if mig:
                return mig[2].uuid
            return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        with self._lock:
            mig = self._mig(handle)
            if mig:
                gpu, gi, _ = mig
                return f"{self._profile(gpu).product_name} MIG {self._mig_spec_by_index(gpu, gi.profile_index).name}"
            return self._profile(self._gpu(handle)).product_name

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        with self._lock:
            if self._mig(handle):
                raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
            return self._gpu(handle).minor

    def nvmlDeviceGetModuleId(self, handle: Any) -> int:
        """The baseboard module id: 1-based in index order, as on an HGX board."""
        return self._gpu(handle).index + 1

    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        return self._profile(self._gpu(handle, allow_mig=True)).brand

    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:
        return self._profile(self._gpu(handle, allow_mig=True)).architecture

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        return self._profile(self._gpu(handle, allow_mig=True)).cc

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        with self._lock:
            mig = self._mig(handle)
            if mig:
                gpu, gi, _ = mig
                total = self._mig_spec_by_index(gpu, gi.profile_index).memory_mib << 20
            else:
                total = self._profile(self._gpu(handle)).memory_bytes
        mem = N.c_nvmlMemory_t()
        mem.total = total
        mem.used = 0
        mem.free = total
        return mem

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._gpu(handle, allow_mig=True)
        prof = self._profile(gpu)
        domain, bus, rest = gpu.bus_id.split(":")
        device = rest.split(".")[0]
        info = N.nvmlPciInfo_t()
        nvml_id = f"{int(domain, 16):08X}:{bus.upper()}:{device.upper()}.0"
        info.busIdLegacy = nvml_id.encode()[:15]
        info.busId = nvml_id.encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(device, 16)
        info.pciDeviceId = prof.pci_device_id
        info.pciSubSystemId = prof.pci_subsystem_id
        return info

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        return self._gpu(handle).numa_node

    def nvmlDeviceGetAddressingMode(self, handle: Any) -> int:
        mode = self._profile(self._gpu(handle, allow_mig=True)).addressing_mode
        if mode is None:
            raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
        return mode

    # ------------------------------------------------------------------ compute mode / fabric
    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        with self._lock:
            if self._mig(handle):
                raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
            return self._gpu(handle).compute_mode

    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None:
        with self._lock:
            if self._mig(handle):
                raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
            gpu = self._gpu(handle)
            if mode == N.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
                raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
            if mode not in (
                N.NVML_COMPUTEMODE_DEFAULT,
                N.NVML_COMPUTEMODE_PROHIBITED,
                N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
            ):
                raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
            if gpu.compute_mode != mode:
                gpu.compute_mode = mode
                self._persist()

    def _fill_fabric(self, handle: Any, ref: Any) -> None:
        gpu = self._gpu(handle)
        info = out_of(ref)
        info.status = N.NVML_SUCCESS
        if not self._profile(gpu).fabric:
            if self._profile(gpu).architecture < N.NVML_DEVICE_ARCH_HOPPER:
                raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
            info.state = N.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
            return
        raw = uuidlib.UUID(gpu.fabric_cluster_uuid).bytes
        for i, b in enumerate(raw):
            info.clusterUuid[i] = b
        info.cliqueId = gpu.fabric_clique_id
        info.state = N.NVML_GPU_FABRIC_STATE_COMPLETED

    def nvmlDeviceGetGpuFabricInfo(self, handle: Any, ref: Any) -> int:
        self._fill_fabric(handle, ref)
        return SUCCESS

    def nvmlDeviceGetGpuFabricInfoV(self, handle: Any, ref: Any) -> int:
        self._fill_fabric(handle, ref)
        return SUCCESS

    # ------------------------------------------------------------------ MIG state (built at start, and by MIG calls)
    def _free(self, gpu: st.SimGpu, spec: profiles.MigProfileSpec, start: int) -> bool:
        span = set(range(start, start + spec.size))
        for gi in gpu.gis:
            if span & set(range(gi.start, gi.start + gi.size)):
                return False
        same = sum(1 for gi in gpu.gis if gi.profile_index == spec.profile_index)
        if same >= spec.instances:
            return False
        used = sum(self._mig_spec_by_index(gpu, gi.profile_index).slices for gi in gpu.gis)
        return used + spec.slices <= 7

    def _create_gi(self, gpu: st.SimGpu, spec: profiles.MigProfileSpec, start: int, size: int) -> st.SimGi:
        if start not in spec.starts or size != spec.size:
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        if not self._free(gpu, spec, start):
            raise nvml_error(N.NVML_ERROR_INSUFFICIENT_RESOURCES)
        used = {gi.id for gi in gpu.gis}
        gi_id = next(i for i in range(1, 15) if i not in used)
        gi = st.SimGi(id=gi_id, profile_index=spec.profile_index, start=start, size=size)
        gpu.gis.append(gi)
        gpu.gis.sort(key=lambda g: g.id)
        return gi

    def _create_ci(self, gpu: st.SimGpu, gi: st.SimGi, ci_index: int) -> st.SimCi:
        gspec = self._mig_spec_by_index(gpu, gi.profile_index)
        slices = CI_SLICES.get(ci_index)
        if slices is None or slices > gspec.slices:
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        used = sum(CI_SLICES[c.profile_index] for c in gi.cis)
        if used + slices > gspec.slices:
            raise nvml_error(N.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ids = {c.id for c in gi.cis}
        ci_id = next(i for i in range(8) if i not in ids)
        gpu.generation += 1
        mig_uuid = f"MIG-{uuidlib.uuid5(_NS, f'{self._node}/{gpu.index}/{gi.id}/{ci_id}/{gpu.generation}')}"
        ci = st.SimCi(id=ci_id, profile_index=ci_index, uuid=mig_uuid)
        gi.cis.append(ci)
        return ci


def ci_index_for(slices: int) -> int:
    return next(k for k, v in CI_SLICES.items() if v == slices)
