"""`up --metrics-port BASE` hands out ports with `next_free_port`: a port held by a listener, or by a
connection as its local port, is passed over (a service given it would fail to bind at every restart)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

from shared import ports
from shared.ports import ephemeral_range, free_port, next_free_port, port_is_free


def test_a_port_held_by_a_listener_or_as_a_connections_local_port_is_passed_over() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        listening = server.getsockname()[1]
        assert not port_is_free(listening)
        with socket.create_connection(("127.0.0.1", listening)) as conn:
            local = conn.getsockname()[1]
            assert not port_is_free(local), "a connection's local port blocks a bind"
            assert next_free_port(local - 1) != local
            assert next_free_port(listening - 1) != listening
            found = next_free_port(local)
            assert found > local and port_is_free(found)
    assert port_is_free(listening), "free again once closed"


def test_no_free_port_left_in_the_range_is_an_error_naming_it() -> None:
    with socket.create_server(("0.0.0.0", 0)) as server:  # noqa: S104
        held = server.getsockname()[1]
        with pytest.raises(OSError, match=f"no free TCP port in {held}-{held}"):
            next_free_port(held - 1, limit=held)


def test_a_free_port_lies_below_the_ephemeral_range_and_is_free() -> None:
    """Outgoing connections take their local ports from the ephemeral range, so a port picked there can be
    taken by one before its server binds; free_port picks below it."""
    low, _ = ephemeral_range()
    picked = {free_port() for _ in range(20)}
    assert all(10000 <= port < low and port_is_free(port) for port in picked), picked
    assert len(picked) > 1, "random: processes picking at once rarely meet"


def test_a_process_is_not_handed_the_same_free_port_twice_before_it_binds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A NATS cluster fixture picks nine ports before any server binds; the random draw repeating one of them
    (it did: 'bind: address already in use' on a route port) must not hand it out twice."""
    # this process's earlier picks (other tests') are not this test's: one of them was 23456 once
    monkeypatch.setattr(ports, "_HANDED_OUT", deque(maxlen=256))
    monkeypatch.setattr(ports, "CLAIMS", tmp_path / "claims")
    first = next(p for p in range(23456, ephemeral_range()[0] - 1) if port_is_free(p) and port_is_free(p + 1))
    draws = iter([first, first, first + 1])
    monkeypatch.setattr(random, "randrange", lambda _low, _high: next(draws))
    assert [free_port(), free_port()] == [first, first + 1]


CLAIMING_CHILD = """
import sys
from shared.ports import free_port
print(free_port(), flush=True)
sys.stdin.readline()
"""


def test_a_port_another_process_was_handed_is_not_handed_out_until_that_process_exits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A cluster's webhook was given a port that another test process's cluster then gave one of its services
    as a metrics port, both free and neither yet bound; the one that bound second failed at every restart.
    A port handed out is claimed machine-wide until its process exits (or CLAIM_TTL_S passes), whatever
    TMPDIR each process has (the fleet bench runs with one of its own)."""
    monkeypatch.setattr(ports, "_HANDED_OUT", deque(maxlen=256))
    (own_tmp := tmp_path / "own-tmp").mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", CLAIMING_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={"TMPDIR": str(own_tmp), "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        handed = int(child.stdout.readline())
        assert port_is_free(handed), "handed out, not bound: nothing but the claim keeps it"
        assert (ports.CLAIMS / str(handed)).read_text() == str(child.pid)
        assert next_free_port(handed - 1) != handed, "claimed by a running process"
    finally:
        child.communicate("\n", timeout=30)
    assert next_free_port(handed - 1) == handed, "its process exited: the claim is void"
    assert (ports.CLAIMS / str(handed)).read_text() == str(os.getpid())
    assert list(own_tmp.iterdir()) == [], "claims are not kept under a process's own TMPDIR"


def test_a_claim_older_than_its_time_to_live_is_void(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A process that picked a port and never bound it must not keep it from everyone for good."""
    claims = tmp_path / "claims"
    claims.mkdir()
    monkeypatch.setattr(ports, "CLAIMS", claims)
    monkeypatch.setattr(ports, "_HANDED_OUT", deque(maxlen=256))
    port = next(p for p in range(24000, 30000) if port_is_free(p))
    (claims / str(port)).write_text("1")  # pid 1 runs for good
    assert next_free_port(port - 1) != port
    old = (claims / str(port)).stat().st_mtime - ports.CLAIM_TTL_S - 1
    os.utime(claims / str(port), (old, old))
    assert next_free_port(port - 1) == port
