"""The driver root layer: ld cache and ELF SONAME readers, roots and lookups, on a fake driver root."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from shared.driverroot import DriverRoot, DriverRootError, build_ld_cache, parse_ld_cache, read_soname
from tests.fakedriver import DRIVER_VERSION, LIB_DIR, elf_shared_object, make_driver_root


def test_ld_cache_round_trips_and_reads_after_the_old_format_table() -> None:
    entries = [("libcuda.so.1", "/usr/lib64/libcuda.so.1"), ("libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6")]
    new = build_ld_cache(entries)
    assert parse_ld_cache(new) == entries
    # glibc before 2.32 wrote an old-format table first (magic, count, 12-byte entries), the new one 8-aligned after.
    old = b"ld.so-1.7.0" + b"\0" + struct.pack("<I", 1) + struct.pack("<iII", 1, 0, 0)
    old += b"\0" * (-len(old) % 8)
    assert parse_ld_cache(old + new) == entries  # string offsets count from the new table's own header


@pytest.mark.parametrize("damage", ["truncated", "no-magic", "huge-count", "bad-offset"])
def test_a_damaged_ld_cache_is_an_error_not_a_crash(damage: str) -> None:
    data = bytearray(build_ld_cache([("libcuda.so.1", "/usr/lib64/libcuda.so.1")]))
    if damage == "truncated":
        data = data[:30]
    elif damage == "no-magic":
        data[:5] = b"XXXXX"
    elif damage == "huge-count":
        struct.pack_into("<I", data, 20, 0xFFFFFFF)
    else:
        struct.pack_into("<I", data, 48 + 4, 10_000_000)
    with pytest.raises(DriverRootError):
        parse_ld_cache(bytes(data))


def test_soname_of_a_written_shared_object_and_of_things_that_are_not(tmp_path: Path) -> None:
    lib = tmp_path / "libnvidia-ml.so.550.54.15"
    lib.write_bytes(elf_shared_object("libnvidia-ml.so.1"))
    assert read_soname(lib) == "libnvidia-ml.so.1"
    (tmp_path / "text").write_text("not an ELF file at all, but long enough to have a header" * 4)
    assert read_soname(tmp_path / "text") == ""
    (tmp_path / "short").write_bytes(elf_shared_object("libx.so.1")[:70])
    assert read_soname(tmp_path / "short") == ""
    assert read_soname(tmp_path / "missing") == ""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler to build a real shared object")
def test_soname_of_a_shared_object_built_by_the_toolchain(tmp_path: Path) -> None:
    src = tmp_path / "x.c"
    src.write_text("int answer(void) { return 42; }\n")
    out = tmp_path / "libanswer.so.7.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libanswer.so.7", "-o", str(out), str(src)], check=True)
    assert read_soname(out) == "libanswer.so.7"


def test_library_dirs_come_from_the_roots_ld_cache_then_the_standard_dirs(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver", lib_dir="/opt/nvidia/lib")
    (fake.root / "usr" / "lib64").mkdir(parents=True)
    root = DriverRoot.of(str(fake.root))
    assert root.library_dirs()[0] == "/opt/nvidia/lib"
    assert "/usr/lib64" in root.library_dirs()
    assert root.nvml_library() == "/opt/nvidia/lib/libnvidia-ml.so.1"
    assert root.driver_version() == DRIVER_VERSION
    assert root.find_binary("nvidia-smi") == "/usr/bin/nvidia-smi"


def test_without_an_ld_cache_the_standard_dirs_are_searched(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver", ld_cache=False)
    root = DriverRoot.of(str(fake.root))
    assert root.library_dirs() == [LIB_DIR, "/usr/lib", "/lib"]  # /lib holds the firmware
    assert root.driver_version() == DRIVER_VERSION
    assert root.libraries_matching("libcuda.so.*") == [f"{LIB_DIR}/libcuda.so.{DRIVER_VERSION}"]


def test_a_container_driver_root_reads_locally_and_names_host_paths(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "mnt")
    root = DriverRoot.of("/run/nvidia/driver", str(fake.root))
    lib = root.nvml_library()
    assert root.local(lib) == fake.root / lib.lstrip("/")
    assert root.host(lib) == f"/run/nvidia/driver{lib}"
    assert root.dev_host("/dev/nvidiactl") == "/run/nvidia/driver/dev/nvidiactl"
    assert root.dev_local("/dev/nvidiactl") == fake.root / "dev" / "nvidiactl"
    host_dev = DriverRoot.of("/run/nvidia/driver", str(fake.root), "/")
    assert host_dev.dev_host("/dev/nvidia0") == "/dev/nvidia0"


def test_a_root_without_nvml_or_a_relative_root_is_a_clear_error(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver", nvml=False)
    with pytest.raises(DriverRootError, match=r"no libnvidia-ml\.so\.1 under driver root .*driver"):
        DriverRoot.of(str(fake.root)).driver_version()
    with pytest.raises(DriverRootError, match="--container-driver-root must be an absolute path"):
        DriverRoot.of("/", "relative/dir")


def test_a_binary_without_the_exec_bit_is_not_found(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver")
    (fake.root / "usr" / "bin" / "nvidia-smi").chmod(0o644)
    assert DriverRoot.of(str(fake.root)).find_binary("nvidia-smi") == ""
