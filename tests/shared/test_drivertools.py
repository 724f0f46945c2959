"""Running a driver root's binaries: through the root's own loader for an ELF binary, directly (with
the root's library dirs, never one holding a libc) otherwise, bounded, and a clear error when absent."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

from shared.drivertools import DriverTools, ToolError, read_interp
from tests.fakedriver import make_driver_root
from tests.polling import wait_gone

LOADER = "/usr/lib64/ld-linux-x86-64.so.2"  # under usr/ so the recording stub finds the fake root


def elf_executable(interp: str) -> bytes:
    """A minimal ELF64 executable header whose PT_INTERP names `interp` (never executed directly here)."""
    ehdr, phdr = struct.Struct("<16sHHIQQQIHHHHHH"), struct.Struct("<IIQQQQQQ")
    text = interp.encode() + b"\0"
    off = ehdr.size + phdr.size
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    return (
        ehdr.pack(ident, 2, 62, 1, 0, ehdr.size, 0, 0, ehdr.size, phdr.size, 1, 64, 0, 0)
        + phdr.pack(3, 4, off, off, off, len(text), len(text), 1)
        + text
    )


def test_read_interp_of_elf_and_of_a_script(tmp_path: Path) -> None:
    (tmp_path / "elf").write_bytes(elf_executable(LOADER))
    (tmp_path / "script").write_text("#!/bin/sh\n")
    assert read_interp(tmp_path / "elf") == LOADER
    assert read_interp(tmp_path / "script") == "" and read_interp(tmp_path / "absent") == ""


async def test_an_elf_binary_runs_through_the_roots_loader(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver")
    smi = fake.root / "usr" / "bin" / "nvidia-smi"
    loader = fake.root / LOADER.lstrip("/")
    loader.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(smi, loader)  # a recording stub stands in for the host's ld.so
    smi.write_bytes(elf_executable(LOADER))
    smi.chmod(0o755)
    res = await DriverTools.of(str(fake.root)).run("nvidia-smi", ["-q"])
    assert res.returncode == 0, res.stderr
    [call] = fake.calls("ld-linux-x86-64.so.2")
    flag, dirs, exe, *rest = call["argv"]
    assert (flag, exe, rest) == ("--library-path", str(smi), ["-q"])
    assert dirs.split(":")[0] == str(fake.root / fake.lib_dir.lstrip("/")), "the root's own libraries first"
    assert "LD_LIBRARY_PATH" not in call["env"]


async def test_a_script_runs_directly_without_a_libc_dir_on_the_path(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver")
    res = await DriverTools.of(str(fake.root)).run("nvidia-smi", ["-L"])
    assert res.returncode == 0, res.stderr  # a foreign libc on LD_LIBRARY_PATH would crash the stub
    [call] = fake.calls("nvidia-smi")
    assert str(fake.root / fake.lib_dir.lstrip("/")) not in call["env"].get("LD_LIBRARY_PATH", "").split(":")


async def test_a_missing_binary_names_the_root_and_a_hung_one_is_killed(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver", binaries=("nvidia-smi",))
    tools = DriverTools.of(str(fake.root), timeout=0.5)
    with pytest.raises(ToolError) as missing:
        await tools.run("nvidia-cuda-mps-control", ["-d"])
    assert missing.value.kind == "missing" and str(fake.root) in str(missing.value)
    assert not await tools.has("nvidia-cuda-mps-control") and await tools.has("nvidia-smi")
    fake.hang("nvidia-smi")
    with pytest.raises(ToolError) as hung:
        await tools.run("nvidia-smi", ["-q"])
    assert hung.value.kind == "timeout" and "nvidia-smi -q" in str(hung.value)
    assert wait_gone(fake.calls("nvidia-smi")[-1]["pid"], timeout=2)
