"""Unix-socket listeners for the kubelet: path checks, safe replacement of a stale socket, clean removal.

A server binds a hidden temporary name in the target directory and is renamed into place only once
it is serving, so the kubelet (which ignores dot-files) never dials a socket that is not answering,
and a restarted preparer replaces the old socket atomically. A non-socket in the way is refused.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import grpc

UNIX_PATH_MAX = 107  # sun_path holds 108 bytes including the terminating NUL


class SocketError(RuntimeError):
    """A socket path cannot be used; the message names it and says why."""


def check_path(path: Path) -> None:
    if not path.is_absolute():
        raise SocketError(f"socket path {path} must be absolute (the kubelet dials it verbatim)")
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise SocketError(
            f"socket path {path} is {len(os.fsencode(path))} bytes; unix sockets allow at most "
            f"{UNIX_PATH_MAX}: choose a shorter --registry-dir/--plugins-dir"
        )
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketError(f"{path} exists and is not a socket; remove it or choose another directory")


async def serve_on(server: grpc.aio.Server, path: Path) -> None:
    """Start `server` on the unix socket `path`, replacing any stale socket there."""
    check_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        server.add_insecure_port(f"unix:{tmp}")
    except RuntimeError as exc:
        raise SocketError(f"cannot listen on {tmp}: {exc}") from exc
    await server.start()
    os.replace(tmp, path)


def remove(path: Path) -> None:
    """Remove our socket on clean shutdown (absent is fine; never a non-socket)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
