"""What a compute container gets from tests/fakedriver.py's driver root (the toolkit's facts applied to
its files), and a driver upgrade in place: shared by the common-edits, preparer and `cdi generate` tests."""

from __future__ import annotations

from pathlib import Path

from tests.fakedriver import elf_shared_object

V = "550.54.15"
LIB = "/usr/lib/x86_64-linux-gnu"
# What a compute container gets from the fake driver (graphics-only ones and libc are not in it).
EXPECTED_LIBRARIES = sorted(
    f"{LIB}/{name}"
    for name in (
        f"libcuda.so.{V}",
        f"libcudadebugger.so.{V}",
        f"libnvidia-ml.so.{V}",
        f"libnvidia-ptxjitcompiler.so.{V}",
        f"libnvidia-nvvm.so.{V}",
        f"libnvidia-cfg.so.{V}",
        f"libnvidia-opencl.so.{V}",
        f"libnvidia-allocator.so.{V}",
        f"libnvidia-gpucomp.so.{V}",
        f"libnvidia-pkcs11-openssl3.so.{V}",
        "libnvidia-nvvm70.so.4",
    )
)
EXPECTED_BINARIES = [
    f"/usr/bin/{b}"
    for b in (
        "nvidia-smi",
        "nvidia-debugdump",
        "nvidia-persistenced",
        "nvidia-cuda-mps-control",
        "nvidia-cuda-mps-server",
        "nvidia-imex",
        "nvidia-imex-ctl",
    )
]
EXPECTED_FIRMWARE = [f"/lib/firmware/nvidia/{V}/gsp_ga10x.bin", f"/lib/firmware/nvidia/{V}/gsp_tu10x.bin"]
EXPECTED_IPC = ["/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket"]


def expected_hook_args(lib: str = LIB, version: str = V) -> list[list[str]]:
    links = [
        f"libcuda.so.{version}::{lib}/libcuda.so.1",
        f"libcuda.so.1::{lib}/libcuda.so",
        f"libcudadebugger.so.{version}::{lib}/libcudadebugger.so.1",
        f"libnvidia-allocator.so.{version}::{lib}/libnvidia-allocator.so.1",
        f"libnvidia-cfg.so.{version}::{lib}/libnvidia-cfg.so.1",
        f"libnvidia-ml.so.{version}::{lib}/libnvidia-ml.so.1",
        f"libnvidia-nvvm.so.{version}::{lib}/libnvidia-nvvm.so.4",
        f"libnvidia-opencl.so.{version}::{lib}/libnvidia-opencl.so.1",
        f"libnvidia-ptxjitcompiler.so.{version}::{lib}/libnvidia-ptxjitcompiler.so.1",
    ]
    return [
        ["nvidia-cdi-hook", "create-symlinks", *[a for link in links for a in ("--link", link)]],
        ["nvidia-cdi-hook", "enable-cuda-compat", f"--host-driver-version={version}"],
        ["nvidia-cdi-hook", "update-ldcache", "--folder", lib],
        ["nvidia-cdi-hook", "disable-device-node-modification"],
    ]


def upgrade(root: Path, lib_dir: str, version: str, *, cuda: bool = True) -> None:
    """Install another driver version's NVML (and libcuda) and point the SONAME links at it."""
    libs = root / lib_dir.lstrip("/")
    for name, soname in (
        (f"libnvidia-ml.so.{version}", "libnvidia-ml.so.1"),
        *(((f"libcuda.so.{version}", "libcuda.so.1"),) if cuda else ()),
    ):
        (libs / name).write_bytes(elf_shared_object(soname))
        (libs / soname).unlink()
        (libs / soname).symlink_to(name)
