"""TCP ports for local runs: a free one below the kernel's ephemeral range, or the next free one after a base.

A port handed out is free but not yet bound: the process given it binds it a moment (or, on a loaded machine,
seconds) later. Until then it is claimed, in this process and in a file under `CLAIMS` that every process on
the machine picking through this module honours, so that two pickers never hand out one port: a webhook's
port and another cluster's metrics port did meet, and the one that bound second failed at every restart.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from collections import deque
from pathlib import Path

LOWEST = 10000  # below: ports services commonly use
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# one file per port handed out lately, naming its process: one place for every process of this user on the
# machine, whatever its TMPDIR (a process with a TMPDIR of its own must still see the others' claims)
CLAIMS = Path("/tmp") / f"gpu-dra-ports-{os.getuid()}"
CLAIM_TTL_S = 600.0  # a claim older than this is void: its process bound the port long since, or never will
_HANDED_OUT: deque[int] = deque(maxlen=256)  # this process's last picks: free still, perhaps, but promised


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: between this pick and the bind of the server
    given it, the kernel never hands it out as an outgoing connection's local port (a port of that range can
    be: a nats-server's route port taken by a peer's dial). Random, so that processes picking at once
    rarely meet, and never one claimed (`_claim`): a caller picking several before it binds any, as a
    three-server NATS cluster's nine, would otherwise get the same one twice now and then. The kernel's own
    pick when no port below the range is found free."""
    below = ephemeral_range()[0]
    for _ in range(64) if below > LOWEST else ():
        port = random.randrange(LOWEST, below)  # a spread, not a secret
        if port_is_free(port) and _claim(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default when it cannot be read)."""
    try:
        low, high = EPHEMERAL_RANGE.read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_is_free(port: int, host: str = "0.0.0.0") -> bool:  # noqa: S104 - the address a service binds
    """Whether a listener could bind `host:port` now: no listener and no connection holds it (a connection's
    local port blocks a bind just as a listener does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the services' servers bind
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def next_free_port(after: int, *, host: str = "0.0.0.0", limit: int = 65535) -> int:  # noqa: S104
    """The first port above `after` that `port_is_free` and no picker claimed lately; OSError naming the range
    when none is."""
    for port in range(after + 1, limit + 1):
        if port_is_free(port, host) and _claim(port):
            return port
    raise OSError(f"no free TCP port in {after + 1}-{limit}; choose a lower --metrics-port")


def _claim(port: int) -> bool:
    """Claim `port` for this process: False when this process, or another one still running, handed it out
    within `CLAIM_TTL_S`. Creating the claim file is the atomic step; a void one is renamed away first, so of
    two processes finding it void, one claims it."""
    if port in _HANDED_OUT:
        return False
    claim = CLAIMS / str(port)
    try:
        CLAIMS.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if _void(claim):
                stale = CLAIMS / f".void-{port}-{os.getpid()}"
                claim.rename(stale)  # FileNotFoundError: another process took it away first
                stale.unlink()
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        pass  # no shared claims here (a read-only temp dir): this process's own list still holds
    else:
        with os.fdopen(fd, "w") as out:
            out.write(str(os.getpid()))
    _HANDED_OUT.append(port)
    return True


def _void(claim: Path) -> bool:
    """Whether a claim no longer holds: older than `CLAIM_TTL_S`, or its process has exited (an `up`
    restarted on its data dir gets its services' metrics ports back)."""
    if time.time() - claim.stat().st_mtime > CLAIM_TTL_S:
        return True
    try:
        owner = int(claim.read_text() or "0")
    except ValueError:
        return True
    if owner <= 0:
        return False  # being written this instant
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's process, running
    return False
