"""GPU product profiles for the simulated NVML: identity, memory, PCI layout and MIG tables.

Owns the static per-product data only (derived from the mock-NVML reference profiles and
NVIDIA's published MIG tables); nothing here touches NVML or the file system.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pynvml

_P = pynvml  # short alias for the enum constants below


@dataclass(frozen=True)
class MigProfileSpec:
    """One GPU-instance profile as `nvmlDeviceGetGpuInstanceProfileInfo` reports it."""

    name: str  # "1g.10gb"
    profile_index: int  # NVML_GPU_INSTANCE_PROFILE_* (the argument of GetGpuInstanceProfileInfo)
    gi_profile_id: int  # info.id (what nvidia-smi -lgip shows)
    slices: int  # compute slices (info.sliceCount)
    instances: int  # info.instanceCount
    memory_mib: int
    sms: int
    ce: int
    dec: int
    enc: int
    jpeg: int
    ofa: int
    starts: tuple[int, ...]  # valid placement starts (memory slice index)
    size: int  # memory slices per placement


@dataclass(frozen=True)
class GpuProfile:
    """A GPU product as the simulated NVML presents it."""

    key: str
    product_name: str
    architecture: int  # NVML_DEVICE_ARCH_*
    brand: int  # NVML_BRAND_*
    cc: tuple[int, int]
    memory_bytes: int
    pci_device_id: int
    pci_subsystem_id: int
    driver_version: str
    cuda_version: int  # nvmlSystemGetCudaDriverVersion form, e.g. 12040
    bus_ids: tuple[str, ...]
    numa_roots: tuple[tuple[str, int, tuple[str, ...]], ...]  # (pcie root, numa node, bus ids)
    addressing_mode: int | None = None  # None: NOT_SUPPORTED
    fabric: bool = False  # MNNVL-capable (GpuFabricInfo state COMPLETED)
    memory_slices: int = 0
    mig: tuple[MigProfileSpec, ...] = field(default_factory=tuple)

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig)

    def root_of(self, bus_id: str) -> tuple[str, int]:
        for root, numa, buses in self.numa_roots:
            if bus_id.upper() in buses:
                return root, numa
        return "pci0000:00", 0


def _mig(
    names: tuple[str, ...],
    mem: tuple[int, ...],
    sms: tuple[int, ...],
    ce: tuple[int, ...],
    dec: tuple[int, ...],
    jpeg: tuple[int, ...],
    ofa: tuple[int, ...],
) -> tuple[MigProfileSpec, ...]:
    """The 7-compute-slice / 8-memory-slice layout shared by A100, H100, H200, B200 and GB200.

    Rows in order: 1g, 1g+me, 1g (2 memory slices), 2g, 3g, 4g, 7g.
    """
    layout = (
        # profile index, gi id, compute slices, instances, starts, size
        (_P.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, 1, 7, (0, 1, 2, 3, 4, 5, 6), 1),
        (_P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),
        (_P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, 1, 4, (0, 2, 4, 6), 2),
        (_P.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, 2, 3, (0, 2, 4), 2),
        (_P.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, 3, 2, (0, 4), 4),
        (_P.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, 4, 1, (0,), 4),
        (_P.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, 7, 1, (0,), 8),
    )
    return tuple(
        MigProfileSpec(names[i], idx, gid, sl, inst, mem[i], sms[i], ce[i], dec[i], 0, jpeg[i], ofa[i], st, sz)
        for i, (idx, gid, sl, inst, st, sz) in enumerate(layout)
    )


_AMPERE_ENGINES = dict(
    sms=(14, 14, 14, 28, 42, 56, 98),
    ce=(1, 1, 1, 2, 3, 4, 7),
    dec=(0, 1, 1, 1, 2, 2, 5),
    jpeg=(0, 1, 0, 0, 0, 0, 1),
    ofa=(0, 1, 0, 0, 0, 0, 1),
)
_HOPPER_ENGINES = dict(
    sms=(16, 16, 26, 32, 60, 64, 132),
    ce=(1, 1, 1, 2, 3, 4, 8),
    dec=(1, 1, 1, 2, 3, 4, 7),
    jpeg=(1, 1, 1, 2, 3, 4, 7),
    ofa=(0, 1, 0, 0, 0, 0, 1),
)
_BLACKWELL_ENGINES = dict(
    sms=(18, 18, 18, 36, 70, 72, 148),
    ce=(1, 1, 1, 2, 3, 4, 8),
    dec=(1, 1, 1, 2, 3, 4, 7),
    jpeg=(1, 1, 1, 2, 3, 4, 7),
    ofa=(0, 1, 0, 0, 0, 0, 1),
)

MIG_A100_40GB = _mig(
    ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    (4864, 4864, 9856, 9856, 19968, 19968, 40192),
    **_AMPERE_ENGINES,
)
MIG_A100_80GB = _mig(
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    (9728, 9728, 19968, 19968, 40192, 40192, 81152),
    **_AMPERE_ENGINES,
)
MIG_H100_80GB = _mig(
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    (9984, 9984, 20096, 20096, 40448, 40448, 81152),
    **_HOPPER_ENGINES,
)
MIG_H200_141GB = _mig(
    ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    (17664, 17664, 35584, 35584, 71936, 71936, 143616),
    **_HOPPER_ENGINES,
)
MIG_B200 = _mig(
    ("1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"),
    (23040, 23040, 45568, 45568, 91648, 91648, 183808),
    **_BLACKWELL_ENGINES,
)
MIG_GB200 = _mig(
    ("1g.24gb", "1g.24gb+me", "1g.47gb", "2g.47gb", "3g.95gb", "4g.95gb", "7g.186gb"),
    (24064, 24064, 47616, 47616, 96768, 96768, 189952),
    **_BLACKWELL_ENGINES,
)
MIG_GB300 = _mig(
    ("1g.34gb", "1g.34gb+me", "1g.67gb", "2g.67gb", "3g.135gb", "4g.135gb", "7g.269gb"),
    (34304, 34304, 68352, 68352, 137728, 137728, 275200),
    **_BLACKWELL_ENGINES,
)

_DGX_A100_BUS = (
    "0000:07:00.0",
    "0000:0F:00.0",
    "0000:47:00.0",
    "0000:4E:00.0",
    "0000:87:00.0",
    "0000:90:00.0",
    "0000:B7:00.0",
    "0000:BD:00.0",
)
_DGX_A100_ROOTS = (("pci0000:00", 0, _DGX_A100_BUS[:4]), ("pci0000:80", 1, _DGX_A100_BUS[4:]))
_HGX_BUS = (
    "0000:1A:00.0",
    "0000:1B:00.0",
    "0000:4A:00.0",
    "0000:4B:00.0",
    "0000:8A:00.0",
    "0000:8B:00.0",
    "0000:CA:00.0",
    "0000:CB:00.0",
)
_HGX_ROOTS = (("pci0000:00", 0, _HGX_BUS[:4]), ("pci0000:80", 1, _HGX_BUS[4:]))
_GRACE_BUS = (
    "0000:0A:00.0",
    "0000:0B:00.0",
    "0000:4A:00.0",
    "0000:4B:00.0",
    "0000:8A:00.0",
    "0000:8B:00.0",
    "0000:CA:00.0",
    "0000:CB:00.0",
)
_GRACE_ROOTS = (
    ("pci0000:00", 0, _GRACE_BUS[0:2]),
    ("pci0000:40", 1, _GRACE_BUS[2:4]),
    ("pci0000:80", 2, _GRACE_BUS[4:6]),
    ("pci0000:c0", 3, _GRACE_BUS[6:8]),
)
_L40S_BUS = (
    "0000:17:00.0",
    "0000:31:00.0",
    "0000:B1:00.0",
    "0000:CA:00.0",
    "0000:18:00.0",
    "0000:32:00.0",
    "0000:B2:00.0",
    "0000:CB:00.0",
)
_L40S_ROOTS = (
    ("pci0000:00", 0, ("0000:17:00.0", "0000:18:00.0", "0000:31:00.0", "0000:32:00.0")),
    ("pci0000:80", 1, ("0000:B1:00.0", "0000:B2:00.0", "0000:CA:00.0", "0000:CB:00.0")),
)
_T4_BUS = ("0000:3B:00.0", "0000:86:00.0", "0000:AF:00.0", "0000:D8:00.0")
_T4_ROOTS = (("pci0000:00", 0, _T4_BUS),)

GIB = 1 << 30

PROFILES: dict[str, GpuProfile] = {
    p.key: p
    for p in (
        GpuProfile(
            "a100-40gb",
            "NVIDIA A100-SXM4-40GB",
            _P.NVML_DEVICE_ARCH_AMPERE,
            _P.NVML_BRAND_NVIDIA,
            (8, 0),
            40 * GIB,
            0x20B010DE,
            0x134710DE,
            "550.163.01",
            12040,
            _DGX_A100_BUS,
            _DGX_A100_ROOTS,
            None,
            False,
            8,
            MIG_A100_40GB,
        ),
        GpuProfile(
            "a100-80gb",
            "NVIDIA A100-SXM4-80GB",
            _P.NVML_DEVICE_ARCH_AMPERE,
            _P.NVML_BRAND_NVIDIA,
            (8, 0),
            80 * GIB,
            0x20B210DE,
            0x147F10DE,
            "550.163.01",
            12040,
            _DGX_A100_BUS,
            _DGX_A100_ROOTS,
            None,
            False,
            8,
            MIG_A100_80GB,
        ),
        GpuProfile(
            "h100",
            "NVIDIA H100 80GB HBM3",
            _P.NVML_DEVICE_ARCH_HOPPER,
            _P.NVML_BRAND_NVIDIA,
            (9, 0),
            80 * GIB,
            0x233010DE,
            0x165810DE,
            "550.163.01",
            12040,
            _HGX_BUS,
            _HGX_ROOTS,
            _P.NVML_DEVICE_ADDRESSING_MODE_HMM,
            False,
            8,
            MIG_H100_80GB,
        ),
        GpuProfile(
            "h200",
            "NVIDIA H200",
            _P.NVML_DEVICE_ARCH_HOPPER,
            _P.NVML_BRAND_NVIDIA,
            (9, 0),
            143771 * (1 << 20),
            0x233510DE,
            0x18A610DE,
            "560.35.03",
            12060,
            _HGX_BUS,
            _HGX_ROOTS,
            _P.NVML_DEVICE_ADDRESSING_MODE_HMM,
            False,
            8,
            MIG_H200_141GB,
        ),
        GpuProfile(
            "b200",
            "NVIDIA B200",
            _P.NVML_DEVICE_ARCH_BLACKWELL,
            _P.NVML_BRAND_NVIDIA,
            (10, 0),
            192 * GIB,
            0x234010DE,
            0x181810DE,
            "560.35.03",
            12060,
            _HGX_BUS,
            _HGX_ROOTS,
            _P.NVML_DEVICE_ADDRESSING_MODE_HMM,
            False,
            8,
            MIG_B200,
        ),
        GpuProfile(
            "gb200",
            "NVIDIA GB200",
            _P.NVML_DEVICE_ARCH_BLACKWELL,
            _P.NVML_BRAND_NVIDIA,
            (10, 0),
            192 * GIB,
            0x233010DE,
            0x181710DE,
            "580.65.06",
            13000,
            _GRACE_BUS,
            _GRACE_ROOTS,
            _P.NVML_DEVICE_ADDRESSING_MODE_ATS,
            True,
            8,
            MIG_GB200,
        ),
        GpuProfile(
            "gb300",
            "NVIDIA GB300 NVL",
            _P.NVML_DEVICE_ARCH_BLACKWELL,
            _P.NVML_BRAND_NVIDIA,
            (10, 0),
            288 * GIB,
            0x294110DE,
            0x183010DE,
            "570.124.06",
            12080,
            _GRACE_BUS,
            _GRACE_ROOTS,
            _P.NVML_DEVICE_ADDRESSING_MODE_ATS,
            True,
            8,
            MIG_GB300,
        ),
        GpuProfile(
            "l40s",
            "NVIDIA L40S",
            _P.NVML_DEVICE_ARCH_ADA,
            _P.NVML_BRAND_NVIDIA,
            (8, 9),
            48 * GIB,
            0x26B510DE,
            0x169710DE,
            "550.163.01",
            12040,
            _L40S_BUS,
            _L40S_ROOTS,
        ),
        GpuProfile(
            "t4",
            "NVIDIA T4",
            _P.NVML_DEVICE_ARCH_TURING,
            _P.NVML_BRAND_NVIDIA,
            (7, 5),
            16 * GIB,
            0x1EB810DE,
            0x12A210DE,
            "550.163.01",
            12040,
            _T4_BUS,
            _T4_ROOTS,
        ),
    )
}

ALIASES: dict[str, str] = {
    "a100": "a100-40gb",
    "a100-40g": "a100-40gb",
    "a100-80g": "a100-80gb",
    "h100-80gb": "h100",
    "h200-141gb": "h200",
}

DEFAULT_CLUSTER_UUID = "6f2a9c1e-3b4d-5e6f-8a9b-0c1d2e3f4a5b"  # one simulated NVL72 rack
DEFAULT_CLIQUE_ID = 1


def lookup(name: str) -> GpuProfile:
    """The profile called `name` (case-insensitive, aliases allowed); KeyError names the choices."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PROFILES:
        raise KeyError(f"unknown GPU profile {name!r}; valid profiles: {', '.join(choices())}")
    return PROFILES[key]


def choices() -> list[str]:
    return sorted(PROFILES)
