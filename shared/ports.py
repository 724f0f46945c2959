"""TCP ports for local runs: one the kernel picks, or the next free one after a base."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on loopback now (the kernel's pick, from the ephemeral range)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
