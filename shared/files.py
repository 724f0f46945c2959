"""Crash-safe file replacement: the one way services write state files that must survive a crash.

Owns `atomic_write` (temp file, fsync, rename, fsync of the directory; a caller whose file a power loss
makes moot anyway may skip either fsync), `SlotFile` (the same replacement for such a file written often,
without creating or freeing a file per write), the count of the fsyncs it makes (`gpu_dra_fsyncs_total`, by
`what`: file or dir; the benches read it) and the node's boot id, which tells a state file written
before a reboot (whose processes and GPU settings are gone) from a current one. Blocking: call from
a thread.
"""

from __future__ import annotations

import contextlib
import os
import weakref
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


def _fsync_dir(directory: str | Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
        _DIR_FSYNCS.inc()
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes, *, sync_dir: bool = True, sync_file: bool = True) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new file, never a torn one.
    A process crash never does, fsync or not. Against a power loss: `sync_dir=False` lets the rename be
    lost (the old file stays) and `sync_file=False` the data too (a torn or empty file may be left);
    for callers whose state a reboot throws away anyway (their module doc says why). `path` may be a str: a
    caller writing a file per object (per claim) keeps its names out of pathlib, which interns each part."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        if sync_file:
            out.flush()
            os.fsync(out.fileno())
            _FILE_FSYNCS.inc()
    os.replace(tmp, path)
    if sync_dir:
        _fsync_dir(directory or ".")


class BootMarker:
    """`<name>.boot` beside a state file whose writes are not synced: the boot id those writes belong to,
    recorded (file and directory fsync'd) once per boot before the first of them. At the next start a
    marker naming another boot says the node went down since (a power loss or a kernel crash), so the file
    is state of a past boot, whatever its last writes left (a torn file included)."""

    def __init__(self, path: Path, boot_id: str) -> None:
        self.path = Path(path)
        self.boot_id = boot_id
        try:
            self.marked = self.path.read_text().strip()
        except OSError:
            self.marked = ""  # none yet: a first start, or writes that were all synced

    @property
    def rebooted(self) -> bool:
        """Whether the marker names another boot than this one."""
        return bool(self.boot_id and self.marked and self.marked != self.boot_id)

    def mark(self) -> None:
        """Record this boot (once: nothing is written when the marker names it already); OSError if not."""
        if self.marked != self.boot_id:
            atomic_write(self.path, f"{self.boot_id}\n".encode())
            self.marked = self.boot_id


def fill_in_place(path: Path, data: bytes, *, create: bool = False) -> None:
    """Overwrite the file at `path` with `data` in place (its inode kept: nothing allocated or freed but the
    blocks its size change needs). Not atomic: for a file no reader trusts until it is renamed into place.
    FileNotFoundError when it is gone (and `create` is False)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
    try:
        os.pwrite(fd, data, 0)
        if os.fstat(fd).st_size > len(data):  # only a shorter content needs its tail cut: a truncate costs
            os.ftruncate(fd, len(data))  # ~20 us even when it changes nothing
    finally:
        os.close(fd)


class SlotFile:
    """`path` replaced whole with no inode created or freed per write (each costs a journal transaction on
    ext4, 0.15-0.2 ms on the benchmark machine; the write below costs ~0.02 ms). Two slot inodes stay linked
    beside it (`.<name>.slot-a`, `.slot-b`): a write fills the one `path` does not name, in place, links it
    under a third name and renames that over `path`; the inode `path` named keeps its slot link, so the
    rename frees nothing. A process crash leaves `path` whole, old or new (a crash can only tear the spare
    slot). No fsync: only for a file whose state a power loss makes moot (the caller's module doc says
    why). `open` (re)builds the slots from what `path` is now; it and `write` block briefly (small writes
    may be made on the event loop)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.slots = [self.path.with_name(f".{self.path.name}.slot-{n}") for n in "ab"]
        self._link = self.path.with_name(f".{self.path.name}.link")
        self._current = 1  # the slot `path` names (the next write fills the other)

    def open(self) -> None:
        """Link the slots anew: slot a to the file `path` is now (if any), slot b empty. OSError where the
        filesystem has no hard links (the caller then replaces the file the usual way)."""
        for stale in (*self.slots, self._link):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        try:
            os.link(self.path, self.slots[0])
            self._current = 0
        except FileNotFoundError:
            self._current = 1
        for slot in self.slots:
            os.close(os.open(slot, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))

    def write(self, data: bytes) -> None:
        spare = 1 - self._current
        fill_in_place(self.slots[spare], data, create=True)
        try:
            os.link(self.slots[spare], self._link)
        except FileExistsError:  # left by a crash between the link and the rename
            self._link.unlink()
            os.link(self.slots[spare], self._link)
        os.replace(self._link, self.path)
        self._current = spare


class AppendFile:
    """Appends to `path` through one descriptor kept open (O_APPEND, created if missing): no open and close
    per append. `reopen()` after the file at `path` was replaced (a compaction renamed a new one over it), so
    the next append goes to the new file; the descriptor is closed with the object. Blocking, like the rest."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._finalizer: weakref.finalize[..., AppendFile] | None = None

    def append(self, data: bytes) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._finalizer = weakref.finalize(self, os.close, self._fd)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def reopen(self) -> None:
        """Close the descriptor: the next append opens `path` anew."""
        if self._finalizer is not None:
            self._finalizer()  # closes it, once
        self._fd, self._finalizer = None, None


__all__ = [
    "BOOT_ID_PATH",
    "FSYNCS",
    "AppendFile",
    "BootMarker",
    "SlotFile",
    "atomic_write",
    "fill_in_place",
    "fsync_count",
    "read_boot_id",
]
