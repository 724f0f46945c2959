"""The simulated NVML's MIG calls: MIG mode, GPU and compute instance profiles, placements, creation and
destruction, and MIG device handles, with pynvml's signatures and NVMLError codes."""

from __future__ import annotations

from typing import Any

import pynvml as N

from services.discovery.simnvml import state as st
from services.discovery.simnvml.core import (
    CI_SLICES,
    KIND_CI,
    KIND_GI,
    KIND_GPU,
    KIND_MIG,
    SUCCESS,
    SimCore,
    as_handle,
    decode_handle,
    handle_addr,
    nvml_error,
    out_of,
)


class SimMig(SimCore):
    # ------------------------------------------------------------------ MIG
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        gpu = self._gpu(handle)
        self._require_mig_capable(gpu)
        mode = N.NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else N.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceSetMigMode(self, handle: Any, mode: int) -> int:
        with self._lock:
            gpu = self._gpu(handle)
            self._require_mig_capable(gpu)
            if mode not in (N.NVML_DEVICE_MIG_ENABLE, N.NVML_DEVICE_MIG_DISABLE):
                raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
            enable = mode == N.NVML_DEVICE_MIG_ENABLE
            if not enable and gpu.gis:
                raise nvml_error(N.NVML_ERROR_IN_USE)
            if gpu.mig_enabled != enable:
                gpu.mig_enabled = enable
                self._persist()
            return SUCCESS

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        self._require_mig_capable(gpu)
        return max(m.instances for m in self._profile(gpu).mig)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int, version: int = 2) -> Any:
        gpu = self._gpu(handle)
        self._require_mig_capable(gpu)
        if not 0 <= profile < N.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
        spec = next((m for m in self._profile(gpu).mig if m.profile_index == profile), None)
        if spec is None:
            raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
        info = N.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else N.c_nvmlGpuInstanceProfileInfo_t()
        info.id = spec.gi_profile_id
        info.isP2pSupported = 0
        info.sliceCount = spec.slices
        info.instanceCount = spec.instances
        info.multiprocessorCount = spec.sms
        info.copyEngineCount = spec.ce
        info.decoderCount = spec.dec
        info.encoderCount = spec.enc
        info.jpegCount = spec.jpeg
        info.ofaCount = spec.ofa
        info.memorySizeMB = spec.memory_mib
        if version == 2:
            info.name = f"MIG {spec.name}".encode()
        return info

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, handle: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        gpu = self._gpu(handle)
        self._require_mig_capable(gpu)
        spec = self._mig_spec_by_id(gpu, profileId)
        count = out_of(countRef)
        if placementsRef is not None:
            arr = out_of(placementsRef)
            if hasattr(arr, "__len__") and len(arr) < len(spec.starts):
                count.value = len(spec.starts)
                raise nvml_error(N.NVML_ERROR_INSUFFICIENT_SIZE)
            for i, start in enumerate(spec.starts):
                arr[i].start = start
                arr[i].size = spec.size
        count.value = len(spec.starts)
        return SUCCESS

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, handle: Any, profileId: int) -> int:
        with self._lock:
            gpu = self._gpu(handle)
            spec = self._mig_spec_by_id(gpu, profileId)
            if not gpu.mig_enabled:
                raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
            return sum(1 for s in spec.starts if self._free(gpu, spec, s))

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profileId: int, placement: Any) -> Any:
        with self._lock:
            gpu = self._gpu(handle)
            self._require_mig_capable(gpu)
            if not gpu.mig_enabled:
                raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
            spec = self._mig_spec_by_id(gpu, profileId)
            pl = out_of(placement)
            gi = self._create_gi(gpu, spec, int(pl.start), int(pl.size))
            self._persist()
            return as_handle(N.c_nvmlGpuInstance_t, handle_addr(KIND_GI, gpu.index, gi.id))

    def nvmlDeviceGetGpuInstances(self, handle: Any, profileId: int, gpuInstancesRef: Any, countRef: Any) -> int:
        with self._lock:
            gpu = self._gpu(handle)
            self._require_mig_capable(gpu)
            spec = self._mig_spec_by_id(gpu, profileId)
            found = [gi for gi in gpu.gis if gi.profile_index == spec.profile_index]
            arr = out_of(gpuInstancesRef)
            for i, gi in enumerate(found):
                arr[i] = as_handle(N.c_nvmlGpuInstance_t, handle_addr(KIND_GI, gpu.index, gi.id))
            out_of(countRef).value = len(found)
            return SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gpuInstanceId: int) -> Any:
        with self._lock:
            gpu = self._gpu(handle)
            self._require_mig_capable(gpu)
            if not gpu.mig_enabled:
                raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
            if not any(gi.id == gpuInstanceId for gi in gpu.gis):
                raise nvml_error(N.NVML_ERROR_NOT_FOUND)
            return as_handle(N.c_nvmlGpuInstance_t, handle_addr(KIND_GI, gpu.index, gpuInstanceId))

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        with self._lock:
            gpu, gi = self._gi_of(gpuInstance)
            info = N.c_nvmlGpuInstanceInfo_t()
            info.device = as_handle(N.c_nvmlDevice_t, handle_addr(KIND_GPU, gpu.index))
            info.id = gi.id
            info.profileId = self._mig_spec_by_index(gpu, gi.profile_index).gi_profile_id
            info.placement.start = gi.start
            info.placement.size = gi.size
            return info

    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        with self._lock:
            gpu, gi = self._gi_of(gpuInstance)
            if gi.cis:
                raise nvml_error(N.NVML_ERROR_IN_USE)
            gpu.gis.remove(gi)
            self._persist()
            return SUCCESS

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gpuInstance: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        with self._lock:
            gpu, gi = self._gi_of(gpuInstance)
            gspec = self._mig_spec_by_index(gpu, gi.profile_index)
            slices = CI_SLICES.get(profile)
            if slices is None or slices > gspec.slices:
                raise nvml_error(N.NVML_ERROR_NOT_SUPPORTED)
            info = N.c_nvmlComputeInstanceProfileInfo_v2_t() if version == 2 else N.c_nvmlComputeInstanceProfileInfo_t()
            info.id = profile
            info.sliceCount = slices
            info.instanceCount = gspec.slices // slices
            info.multiprocessorCount = gspec.sms * slices // gspec.slices
            info.sharedCopyEngineCount = gspec.ce
            info.sharedDecoderCount = gspec.dec
            info.sharedEncoderCount = gspec.enc
            info.sharedJpegCount = gspec.jpeg
            info.sharedOfaCount = gspec.ofa
            if version == 2:
                info.name = f"MIG {slices}c.{gspec.name}".encode()
            return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        with self._lock:
            gpu, gi = self._gi_of(gpuInstance)
            ci = self._create_ci(gpu, gi, profileId)
            self._persist()
            return as_handle(N.c_nvmlComputeInstance_t, handle_addr(KIND_CI, gpu.index, gi.id, ci.id))

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        with self._lock:
            gpu, gi = self._gi_of(gpuInstance)
            found = [c for c in gi.cis if c.profile_index == profileId]
            arr = out_of(computeInstancesRef)
            for i, c in enumerate(found):
                arr[i] = as_handle(N.c_nvmlComputeInstance_t, handle_addr(KIND_CI, gpu.index, gi.id, c.id))
            out_of(countRef).value = len(found)
            return SUCCESS

    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: Any, computeInstanceId: int) -> Any:
        with self._lock:
            gpu, gi = self._gi_of(gpuInstance)
            if not any(c.id == computeInstanceId for c in gi.cis):
                raise nvml_error(N.NVML_ERROR_NOT_FOUND)
            return as_handle(N.c_nvmlComputeInstance_t, handle_addr(KIND_CI, gpu.index, gi.id, computeInstanceId))

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        with self._lock:
            gpu, gi, ci = self._ci_of(computeInstance)
            info = N.c_nvmlComputeInstanceInfo_t()
            info.device = as_handle(N.c_nvmlDevice_t, handle_addr(KIND_MIG, gpu.index, gi.id, ci.id))  # the MIG device
            info.gpuInstance = as_handle(N.c_nvmlGpuInstance_t, handle_addr(KIND_GI, gpu.index, gi.id))
            info.id = ci.id
            info.profileId = ci.profile_index
            info.placement.start = 0
            info.placement.size = CI_SLICES[ci.profile_index]
            return info

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        with self._lock:
            _, gi, ci = self._ci_of(computeInstance)
            gi.cis.remove(ci)
            self._persist()
            return SUCCESS

    def _mig_list(self, gpu: st.SimGpu) -> list[tuple[st.SimGi, st.SimCi]]:
        return [(gi, ci) for gi in sorted(gpu.gis, key=lambda g: g.id) for ci in sorted(gi.cis, key=lambda c: c.id)]

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any:
        with self._lock:
            gpu = self._gpu(handle)
            self._require_mig_capable(gpu)
            devs = self._mig_list(gpu)
            if not 0 <= index < len(devs):
                raise nvml_error(N.NVML_ERROR_NOT_FOUND)
            gi, ci = devs[index]
            return as_handle(N.c_nvmlDevice_t, handle_addr(KIND_MIG, gpu.index, gi.id, ci.id))

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> bool:
        return decode_handle(handle)[0] == KIND_MIG

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        with self._lock:
            mig = self._mig(handle)
            if not mig:
                raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
            return mig[1].id

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        with self._lock:
            mig = self._mig(handle)
            if not mig:
                raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
            return mig[2].id

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> Any:
        with self._lock:
            mig = self._mig(handle)
            if not mig:
                raise nvml_error(N.NVML_ERROR_INVALID_ARGUMENT)
            return as_handle(N.c_nvmlDevice_t, handle_addr(KIND_GPU, mig[0].index))
