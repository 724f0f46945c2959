"""TCP ports for local runs: a free one below the kernel's ephemeral range, or the next free one after a base."""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

LOWEST = 10000  # below: ports services commonly use
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_HANDED_OUT: deque[int] = deque(maxlen=256)  # this process's last picks: free still, perhaps, but promised


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: between this pick and the bind of the server
    given it, the kernel never hands it out as an outgoing connection's local port (a port of that range can
    be: a nats-server's route port taken by a peer's dial). Random, so that processes picking at once
    rarely meet, and never one this process handed out lately (a caller picking several before it binds any,
    as a three-server NATS cluster's nine, would otherwise get the same one twice now and then); the kernel's
    own pick when no port below the range is found free."""
    below = ephemeral_range()[0]
    for _ in range(64) if below > LOWEST else ():
        port = random.randrange(LOWEST, below)  # a spread, not a secret
        if port not in _HANDED_OUT and port_is_free(port):
            _HANDED_OUT.append(port)
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
    """The first port above `after` that `port_is_free`; OSError naming the range when none is."""
    for port in range(after + 1, limit + 1):
        if port_is_free(port, host):
            return port
    raise OSError(f"no free TCP port in {after + 1}-{limit}; choose a lower --metrics-port")
