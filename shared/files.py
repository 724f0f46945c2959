"""Crash-safe file replacement: the one way services write state files that must survive a crash.

Owns `atomic_write` (temp file, fsync, rename, fsync of the directory) and the node's boot id, which
tells a state file written before a reboot (whose processes and GPU settings are gone) from a current
one. Blocking: call from a thread.
"""

from __future__ import annotations

import os
from pathlib import Path

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    """The kernel's boot id ("" where it cannot be read)."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


__all__ = ["BOOT_ID_PATH", "atomic_write", "read_boot_id"]
