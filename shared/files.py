"""Crash-safe file replacement: the one way services write state files that must survive a crash.

Owns `atomic_write` (temp file, fsync, rename, fsync of the directory; a caller whose file a power loss
makes moot anyway may skip either fsync), the count of the fsyncs it makes (`gpu_dra_fsyncs_total`, by
`what`: file or dir; the benches read it) and the node's boot id, which tells a state file written
before a reboot (whose processes and GPU settings are gone) from a current one. Blocking: call from
a thread.
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import REGISTRY, Counter

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

FSYNCS = Counter("gpu_dra_fsyncs", "fsync calls made by crash-safe file writes", ["what"])
_FILE_FSYNCS = FSYNCS.labels("file")
_DIR_FSYNCS = FSYNCS.labels("dir")


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    """The kernel's boot id ("" where it cannot be read)."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def fsync_count() -> int:
    """fsyncs made by this process's `atomic_write` calls so far (file and directory)."""
    return int(sum(REGISTRY.get_sample_value("gpu_dra_fsyncs_total", {"what": what}) or 0 for what in ("file", "dir")))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
        _DIR_FSYNCS.inc()
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, sync_dir: bool = True, sync_file: bool = True) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new file, never a torn one.
    A process crash never does, fsync or not. Against a power loss: `sync_dir=False` lets the rename be
    lost (the old file stays) and `sync_file=False` the data too (a torn or empty file may be left);
    for callers whose state a reboot throws away anyway (their module doc says why)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        if sync_file:
            out.flush()
            os.fsync(out.fileno())
            _FILE_FSYNCS.inc()
    os.replace(tmp, path)
    if sync_dir:
        _fsync_dir(path.parent)


__all__ = ["BOOT_ID_PATH", "FSYNCS", "atomic_write", "fsync_count", "read_boot_id"]
