"""The host's NVIDIA driver as files: where its libraries, binaries, firmware and device nodes are.

Owns the three roots every real-node path needs (facts from NVIDIA's container toolkit):
  host root       where the driver's files are on the host (`/`, or `/run/nvidia/driver` with the GPU
                  operator); CDI host paths are written under it
  container root  where this process sees the host root, when it runs in a container with the host's
                  driver root mounted elsewhere (default: the host root)
  dev root        where `/dev/nvidia*` are on the host (default: the host root)
and the lookups under them: the driver's library directories (from the root's own ld cache
`etc/ld.so.cache`, else the standard directories), the driver version (from the versioned file behind
`libnvidia-ml.so.1`), libraries, binaries and ELF SONAMEs. Blocking file I/O: call from a thread.
Running the root's binaries is shared.drivertools' job.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

NVML_SONAME = "libnvidia-ml.so.1"
# Standard library dirs, searched in this order when the driver root has no ld cache.
STANDARD_LIB_DIRS = (
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib",
    "/lib",
)
BINARY_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin")
LD_CACHE = "/etc/ld.so.cache"
_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?\Z", re.ASCII)


class DriverRootError(RuntimeError):
    """The driver root is missing, incomplete or inconsistent; the message names the path and the fix."""


# ---------------------------------------------------------------------------------------- ld cache
_NEW_MAGIC = b"glibc-ld.so.cache1.1"
_OLD_MAGIC = b"ld.so-1.7.0"
_NEW_HEADER = struct.Struct("<20sII4xI12x")  # magic+version, nlibs, len_strings, (flags, pad), ext offset
_NEW_ENTRY = struct.Struct("<iIIIQ")  # flags, key, value, osversion, hwcap
_OLD_ENTRY = struct.Struct("<iII")


def _cstr(data: bytes, offset: int) -> str:
    end = data.find(b"\0", offset)
    if offset < 0 or offset >= len(data) or end < 0:
        raise DriverRootError(f"ld cache string offset {offset} is outside the file")
    return data[offset:end].decode("utf-8", "replace")


def parse_ld_cache(data: bytes) -> list[tuple[str, str]]:
    """(library name, path) pairs of a glibc `ld.so.cache` (the new format, alone or after the old one)."""
    start = 0
    if data.startswith(_OLD_MAGIC):
        if len(data) < 16:
            raise DriverRootError("ld cache is truncated")
        (count,) = struct.unpack_from("<I", data, 12)
        start = 16 + count * _OLD_ENTRY.size
        start = (start + 7) & ~7  # the new table is 8-byte aligned after the old one
    table_data = data[start:]  # string offsets in the new table count from its own header
    if not table_data.startswith(_NEW_MAGIC):
        raise DriverRootError("ld cache has no glibc-ld.so.cache1.1 table")
    if len(table_data) < _NEW_HEADER.size:
        raise DriverRootError("ld cache is truncated")
    _, nlibs, _strings, _ext = _NEW_HEADER.unpack_from(table_data, 0)
    if nlibs > (len(table_data) - _NEW_HEADER.size) // _NEW_ENTRY.size:
        raise DriverRootError(f"ld cache claims {nlibs} entries, more than the file holds")
    out: list[tuple[str, str]] = []
    for i in range(nlibs):
        _flags, key, value, _os, _hw = _NEW_ENTRY.unpack_from(table_data, _NEW_HEADER.size + i * _NEW_ENTRY.size)
        out.append((_cstr(table_data, key), _cstr(table_data, value)))
    return out


def build_ld_cache(entries: list[tuple[str, str]]) -> bytes:
    """A new-format `ld.so.cache` holding `entries` (name, path): what `ldconfig -r ROOT` would write."""
    strings = bytearray()
    offsets: list[tuple[int, int]] = []
    base = _NEW_HEADER.size + len(entries) * _NEW_ENTRY.size
    for name, path in entries:
        key = base + len(strings)
        strings += name.encode() + b"\0"
        value = base + len(strings)
        strings += path.encode() + b"\0"
        offsets.append((key, value))
    out = bytearray(_NEW_HEADER.pack(_NEW_MAGIC, len(entries), len(strings), 0))
    for key, value in offsets:
        out += _NEW_ENTRY.pack(0x0303, key, value, 0, 0)  # FLAG_ELF_LIBC6 | FLAG_X8664_LIB64
    return bytes(out + strings)


# ---------------------------------------------------------------------------------------- ELF SONAME
_DT_NULL, _DT_STRTAB, _DT_SONAME = 0, 5, 14
_PT_LOAD, _PT_DYNAMIC = 1, 2


def read_soname(path: str | Path) -> str:
    """The DT_SONAME of a 64- or 32-bit ELF shared object; "" when it has none or is not ELF.

    Reads only the headers, the dynamic segment and the one string (driver libraries are large)."""
    try:
        with open(path, "rb") as f:
            return _soname(f)
    except (OSError, struct.error, ValueError):
        return ""


def _soname(f: BinaryIO) -> str:
    def read(offset: int, size: int) -> bytes:
        f.seek(offset)
        data = f.read(size)
        if len(data) != size:
            raise ValueError("truncated ELF file")
        return data

    ident = f.read(64)
    if len(ident) < 52 or ident[:4] != b"\x7fELF":
        return ""
    is64, e = ident[4] == 2, "<" if ident[5] == 1 else ">"
    if is64:
        phoff = struct.unpack_from(e + "Q", ident, 32)[0]
        phentsize, phnum = struct.unpack_from(e + "HH", ident, 54)
        ph, dyn = struct.Struct(e + "IIQQQQQQ"), struct.Struct(e + "qQ")
    else:
        phoff = struct.unpack_from(e + "I", ident, 28)[0]
        phentsize, phnum = struct.unpack_from(e + "HH", ident, 42)
        ph, dyn = struct.Struct(e + "IIIIIIII"), struct.Struct(e + "iI")
    if phentsize < ph.size or phnum > 512:
        return ""
    table = read(phoff, phentsize * phnum)
    loads: list[tuple[int, int, int]] = []  # vaddr, offset, filesz
    dynamic: tuple[int, int] | None = None
    for i in range(phnum):
        fields = ph.unpack_from(table, i * phentsize)
        if is64:
            p_type, _flags, p_offset, p_vaddr, _p, p_filesz = fields[:6]
        else:
            p_type, p_offset, p_vaddr, _p, p_filesz = fields[:5]
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (p_offset, min(p_filesz, 1 << 20))
    if dynamic is None:
        return ""
    section = read(*dynamic)
    strtab = soname = -1
    for off in range(0, len(section) - dyn.size + 1, dyn.size):
        tag, val = dyn.unpack_from(section, off)
        if tag == _DT_NULL:
            break
        if tag == _DT_STRTAB:
            strtab = val
        elif tag == _DT_SONAME:
            soname = val
    if strtab < 0 or soname < 0:
        return ""
    for vaddr, offset, filesz in loads:
        if vaddr <= strtab < vaddr + filesz:
            f.seek(offset + (strtab - vaddr) + soname)
            raw = f.read(4096)
            end = raw.find(b"\0")
            return raw[:end].decode("utf-8", "replace") if end >= 0 else ""
    return ""


# ---------------------------------------------------------------------------------------- roots
@dataclass(frozen=True)
class DriverRoot:
    """One node's driver files, seen from the host (for CDI) and from this process (for reading)."""

    host_root: str = "/"
    container_root: str = ""
    dev_root: str = ""
    _dirs: list[str] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def of(cls, driver_root: str = "/", container_driver_root: str = "", dev_root: str = "") -> DriverRoot:
        """Roots from the `--driver-root`, `--container-driver-root` and `--dev-root` settings."""
        for name, value in (
            ("--driver-root", driver_root),
            ("--container-driver-root", container_driver_root),
            ("--dev-root", dev_root),
        ):
            if value and not os.path.isabs(value):
                raise DriverRootError(f"{name} must be an absolute path, got {value!r}")
        return cls(
            host_root=driver_root or "/",
            container_root=container_driver_root or driver_root or "/",
            dev_root=dev_root or driver_root or "/",
        )

    # -- path mapping (container paths are absolute paths inside the driver root, e.g. /usr/bin/nvidia-smi)
    @staticmethod
    def _join(root: str, path: str) -> str:
        root = root.rstrip("/")
        return f"{root}{path}" if root else path

    def local(self, path: str) -> Path:
        """Where this process reads `path` of the driver root."""
        return Path(self._join(self.container_root or self.host_root, path))

    def host(self, path: str) -> str:
        """The host's path for `path` of the driver root (what a CDI hostPath names)."""
        return self._join(self.host_root, path)

    def dev_host(self, path: str) -> str:
        """The host's path for a device node path such as /dev/nvidiactl."""
        return self._join(self.dev_root, path)

    def dev_local(self, path: str) -> Path:
        """Where this process reads a device node: under the dev root, seen through the container root
        when the dev root is the driver root."""
        if self.dev_root == self.host_root:
            return self.local(path)
        return Path(self._join(self.dev_root, path))

    # -- lookups
    def library_dirs(self) -> list[str]:
        """The driver root's library directories (container paths): from its ld cache, else the standard ones."""
        if self._dirs:
            return list(self._dirs)
        dirs: list[str] = []
        cache = self.local(LD_CACHE)
        if cache.is_file():
            try:
                entries = parse_ld_cache(cache.read_bytes())
            except (OSError, DriverRootError):
                entries = []
            for _name, path in entries:
                d = os.path.dirname(path)
                if d and d not in dirs:
                    dirs.append(d)
        for d in STANDARD_LIB_DIRS:
            if d not in dirs and self.local(d).is_dir():
                dirs.append(d)
        self._dirs.extend(dirs)
        return dirs

    def find_library(self, name: str) -> str:
        """The container path of a library file or link `name` (e.g. libnvidia-ml.so.1); "" if absent."""
        for d in self.library_dirs():
            if self.local(f"{d}/{name}").exists():
                return f"{d}/{name}"
        return ""

    def libraries_matching(self, pattern: str) -> list[str]:
        """Container paths of regular files matching a glob in the library dirs (sorted, no duplicates)."""
        out: list[str] = []
        seen: set[str] = set()
        for d in self.library_dirs():
            for p in sorted(self.local(d).glob(pattern)):
                if p.is_file() and not p.is_symlink() and p.name not in seen:
                    seen.add(p.name)
                    out.append(f"{d}/{p.name}")
        return out

    def find_binary(self, name: str) -> str:
        """The container path of an executable `name` in the driver root's binary dirs; "" if absent."""
        for d in BINARY_DIRS:
            p = self.local(f"{d}/{name}")
            if p.is_file() and os.access(p, os.X_OK):
                return f"{d}/{name}"
        return ""

    def nvml_library(self) -> str:
        """The container path of libnvidia-ml.so.1, or DriverRootError naming where it looked."""
        found = self.find_library(NVML_SONAME)
        if not found:
            raise DriverRootError(
                f"no {NVML_SONAME} under driver root {self.local('/')} (looked in "
                f"{', '.join(self.library_dirs()) or 'no library directory'}); pass --driver-root (the host's "
                "driver root, e.g. / or /run/nvidia/driver) and --container-driver-root where this container "
                "mounts it"
            )
        return found

    def driver_version(self) -> str:
        """The driver version, from the versioned file behind libnvidia-ml.so.1 (e.g. 550.54.15)."""
        lib = self.nvml_library()
        real = self.local(lib).resolve()
        version = real.name.removeprefix("libnvidia-ml.so.")
        if version == real.name or not _VERSION.match(version):
            candidates = [
                p
                for p in self.libraries_matching("libnvidia-ml.so.*")
                if _VERSION.match(p.rsplit("libnvidia-ml.so.", 1)[1])
            ]
            if len(candidates) != 1:
                raise DriverRootError(
                    f"cannot tell the driver version from {self.local(lib)}: it resolves to {real.name} and the "
                    f"library dirs hold {len(candidates)} libnvidia-ml.so.<version> files; reinstall the driver "
                    "or point --driver-root at a single driver"
                )
            version = candidates[0].rsplit("libnvidia-ml.so.", 1)[1]
        return version


__all__ = ["DriverRoot", "DriverRootError", "build_ld_cache", "parse_ld_cache", "read_soname"]
