"""The simulated NVML's persistent state: GPUs, live GPU/compute instances, sharing, MPS daemons.

Owns the JSON schema and atomic load/save; MIG devices survive a discovery restart like real ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec


class SimCi(msgspec.Struct, kw_only=True):
    id: int
    profile_index: int  # NVML_COMPUTE_INSTANCE_PROFILE_*
    uuid: str


class SimGi(msgspec.Struct, kw_only=True):
    id: int
    profile_index: int  # NVML_GPU_INSTANCE_PROFILE_*
    start: int
    size: int
    cis: list[SimCi] = msgspec.field(default_factory=list)


class SimGpu(msgspec.Struct, kw_only=True):
    index: int
    profile: str
    uuid: str
    minor: int
    bus_id: str  # 0000:1a:00.0
    pcie_root: str
    numa_node: int
    mig_enabled: bool = False
    compute_mode: int = 0
    timeslice: int = 0
    gis: list[SimGi] = msgspec.field(default_factory=list)
    fabric_cluster_uuid: str = ""
    fabric_clique_id: int = 0
    generation: int = 0  # bumps on each MIG create, so a recreated device gets a new UUID


class SimMps(msgspec.Struct, kw_only=True):
    daemon_id: str
    gpu_uuids: list[str]
    active_thread_percentage: int | None = None
    pinned_device_memory_limits: dict[str, int] = msgspec.field(default_factory=dict)
    pipe_dir: str
    shm_dir: str
    log_dir: str


class SimState(msgspec.Struct, kw_only=True):
    node: str
    machine: str  # MachineSpec fingerprint the state was built from
    driver_version: str
    cuda_version: int
    gpus: list[SimGpu]
    mps: dict[str, SimMps] = msgspec.field(default_factory=dict)


def load(path: Path) -> SimState | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=SimState)
    except msgspec.DecodeError:
        return None  # corrupt or older schema: the caller rebuilds from the machine spec


def save(path: Path, state: SimState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state)))
    os.replace(tmp, path)
