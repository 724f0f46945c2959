"""A simulated IMEX daemon: reads nvidia-imex's config files and really connects to its peers over TCP.

Run: `python -m services.computedomain.imexd --config DIR/imexd.cfg` (`--query` asks a running one).
Reads `key=value` lines (`#` comments) as nvidia-imex does; the keys it uses:
  IMEX_NODE_CONFIG_FILE   the nodes config: one peer per line, an IP or a DNS name
  IMEX_CMD_BIND_INTERFACE_IP (or IMEX_BIND_INTERFACE_IP)  this daemon's address (default 127.0.0.1)
  SERVER_PORT (50000), IMEX_CMD_PORT (50005), IMEX_CMD_ENABLED (1)
  IMEX_SIM_HOSTS_FILE     where names resolve (default /etc/hosts); unresolved names are not peers yet
It listens on SERVER_PORT, dials every other peer and keeps the connection (a dropped peer is
redialled with backoff); it is READY when connected to all peers it resolved (alone: at once).
SIGHUP or SIGUSR1 re-reads the config and the names and redials at once. Status goes to stdout as
lines `IMEX-SIM STATUS READY|NOT_READY connected=<n>/<m>` and `IMEX-SIM RELOAD <count> peers=<n>`;
the command port answers `q` with `READY` or `NOT_READY` (what `nvidia-imex-ctl -q` prints).

Standard library only (and `shared.backoff`, which imports nothing), on one `selectors` loop: eighteen of them
start at once when a rack's domain comes up on a test machine, and importing asyncio was half of a start's CPU
(about 35 of 70 ms). `query`, which tests await, imports asyncio when it is called.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import heapq
import ipaddress
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.backoff import Backoff

if TYPE_CHECKING:
    from pathlib import Path

HELLO = b"IMEX-SIM HELLO"
WELCOME = b"IMEX-SIM WELCOME"
CONNECT_TIMEOUT_S = 2.0  # a dial, then the peer's WELCOME
GREETING_TIMEOUT_S = 5.0  # an inbound peer's HELLO, a command's line


class ImexConfigError(ValueError):
    """The config or nodes file is missing or malformed."""


# (a named tuple: a dataclass's import, with inspect's, was 7 ms of every daemon's start)
ImexConfig = collections.namedtuple(
    "ImexConfig", ["bind_ip", "server_port", "cmd_port", "cmd_enabled", "nodes_file", "hosts_file"]
)


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ImexConfigError(f"cannot read {what} {path}: {exc.strerror}") from None


def _parse_kv(path: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(_read(path, "IMEX config").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ImexConfigError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip()
    return values


def _int(values: dict[str, str], key: str, default: int, path: str) -> int:
    raw = values.get(key, "")
    if raw == "":
        return default
    try:
        number = int(raw)
    except ValueError:
        raise ImexConfigError(f"{path}: {key}={raw!r} is not an integer") from None
    if not 0 < number < 65536:
        raise ImexConfigError(f"{path}: {key}={number} is not a TCP port (1..65535)")
    return number


def _beside(config_path: str, name: str) -> str:
    return name if os.path.isabs(name) else os.path.join(os.path.dirname(config_path), name)


def load_config(path: str | Path) -> ImexConfig:
    path = os.fspath(path)
    values = _parse_kv(path)
    nodes = values.get("IMEX_NODE_CONFIG_FILE", "")
    if not nodes:
        raise ImexConfigError(f"{path}: IMEX_NODE_CONFIG_FILE is not set; it names the nodes config")
    bind_ip = values.get("IMEX_CMD_BIND_INTERFACE_IP") or values.get("IMEX_BIND_INTERFACE_IP") or "127.0.0.1"
    try:
        ipaddress.ip_address(bind_ip)
    except ValueError:
        raise ImexConfigError(f"{path}: bind address {bind_ip!r} is not an IP address") from None
    return ImexConfig(
        bind_ip=bind_ip,
        server_port=_int(values, "SERVER_PORT", 50000, path),
        cmd_port=_int(values, "IMEX_CMD_PORT", 50005, path),
        cmd_enabled=values.get("IMEX_CMD_ENABLED", "1") not in ("0", "false", "False"),
        nodes_file=_beside(path, nodes),
        hosts_file=_beside(path, values.get("IMEX_SIM_HOSTS_FILE", "/etc/hosts")),
    )


def read_hosts(path: str) -> dict[str, str]:
    """name -> address from an /etc/hosts-style file (missing file: nothing resolves)."""
    names: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return names
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2:
            for name in fields[1:]:
                names.setdefault(name, fields[0])
    return names


def resolve_peers(config: ImexConfig) -> list[str]:
    """The peers' addresses: nodes-file entries that are IPs or resolve in the hosts file, minus self."""
    entries = [ln.strip() for ln in _read(config.nodes_file, "IMEX nodes config").splitlines()]
    hosts = read_hosts(config.hosts_file)
    peers: list[str] = []
    for entry in entries:
        if not entry or entry.startswith("#"):
            continue
        try:
            address = str(ipaddress.ip_address(entry))
        except ValueError:
            address = hosts.get(entry, "")
        if address and address != config.bind_ip and address not in peers:
            peers.append(address)
    return peers


class _Timer:
    __slots__ = ("fn", "when")

    def __init__(self, when: float, fn: Callable[[], None] | None) -> None:
        self.when = when
        self.fn = fn

    def __lt__(self, other: _Timer) -> bool:
        return self.when < other.when

    def cancel(self) -> None:
        self.fn = None


class _Loop:
    """One selector and a heap of timers: what the daemon's few sockets need."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self._timers: list[_Timer] = []

    def later(self, delay: float, fn: Callable[[], None]) -> _Timer:
        timer = _Timer(time.monotonic() + delay, fn)
        heapq.heappush(self._timers, timer)
        return timer

    def watch(self, sock: socket.socket, events: int, on_ready: Callable[[], None]) -> None:
        try:
            self.selector.modify(sock, events, on_ready)
        except KeyError:
            self.selector.register(sock, events, on_ready)

    def forget(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sock)
        sock.close()

    def run_once(self) -> None:
        while self._timers and self._timers[0].fn is None:
            heapq.heappop(self._timers)
        timeout = max(0.0, self._timers[0].when - time.monotonic()) if self._timers else None
        for key, _ in self.selector.select(timeout):
            key.data()
        now = time.monotonic()
        while self._timers and self._timers[0].when <= now:
            fn = heapq.heappop(self._timers).fn
            if fn is not None:
                fn()


def _recv(sock: socket.socket) -> bytes | None:
    """What arrived; b"" when the peer closed or the connection broke, None when nothing had after all."""
    try:
        return sock.recv(4096)
    except BlockingIOError:
        return None
    except OSError:
        return b""


class _Greeted:
    """An accepted connection that must send one line within GREETING_TIMEOUT_S; `on_line` answers it and says
    whether to keep the connection (read until the peer closes it)."""

    def __init__(self, loop: _Loop, sock: socket.socket, on_line: Callable[[socket.socket, bytes], bool]) -> None:
        self.loop, self.sock, self.on_line = loop, sock, on_line
        self.buffer = b""
        self.greeted = False
        self.deadline: _Timer | None = loop.later(GREETING_TIMEOUT_S, self.close)
        loop.watch(sock, selectors.EVENT_READ, self._readable)

    def _readable(self) -> None:
        data = _recv(self.sock)
        if data == b"":
            self.close()
        elif data is not None and not self.greeted:
            self.buffer += data
            if b"\n" in self.buffer:
                line = self.buffer.split(b"\n", 1)[0]
                self.greeted = True
                if self.deadline is not None:
                    self.deadline.cancel()
                if not self.on_line(self.sock, line):
                    self.close()

    def close(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.loop.forget(self.sock)


def _send(sock: socket.socket, line: bytes) -> bool:
    """One short line on a connected socket (it fits its empty send buffer); False if the connection broke."""
    try:
        return sock.send(line) == len(line)
    except OSError:
        return False


class _Dialer:
    """This daemon's connection to one peer: dial, HELLO, WELCOME, then hold it until it ends; redial after a
    backoff (at once when kicked)."""

    def __init__(self, daemon: Daemon, peer: str) -> None:
        self.daemon, self.peer = daemon, peer
        self.backoff = Backoff(initial_s=0.02, cap_s=1.0)
        self.sock: socket.socket | None = None
        self.timer: _Timer | None = None
        self.state = "waiting"  # waiting | connecting | hello | up
        self.buffer = b""
        self.dial()

    def dial(self) -> None:
        cfg = self.daemon.config
        self._cancel_timer()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((cfg.bind_ip, 0))
            code = sock.connect_ex((self.peer, cfg.server_port))
        except OSError:
            sock.close()
            self._wait()
            return
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            self._wait()
            return
        self.sock, self.state, self.buffer = sock, "connecting", b""
        self.timer = self.daemon.loop.later(CONNECT_TIMEOUT_S, self._end)
        self.daemon.loop.watch(sock, selectors.EVENT_WRITE, self._ready)

    def _ready(self) -> None:
        sock = self.sock
        assert sock is not None
        if self.state == "connecting":
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) or not _send(
                sock, HELLO + b" " + self.daemon.config.bind_ip.encode() + b"\n"
            ):
                self._end()
                return
            self.state = "hello"
            self._cancel_timer()
            self.timer = self.daemon.loop.later(CONNECT_TIMEOUT_S, self._end)  # for the WELCOME
            self.daemon.loop.watch(sock, selectors.EVENT_READ, self._ready)
            return
        data = _recv(sock)
        if data == b"":
            self._end()
        elif data is not None and self.state == "hello":
            self.buffer += data
            if b"\n" in self.buffer:
                if not self.buffer.startswith(WELCOME):
                    self._end()
                    return
                self._cancel_timer()
                self.state = "up"
                self.backoff.reset()
                self.daemon.connected.add(self.peer)
                self.daemon.report()

    def _end(self) -> None:
        """The dial failed or the connection ended: redial after the backoff."""
        if self.sock is not None:
            self.daemon.loop.forget(self.sock)
            self.sock = None
        self.daemon.connected.discard(self.peer)
        self.daemon.report()
        self._wait()

    def _wait(self) -> None:
        self._cancel_timer()
        self.state = "waiting"
        self.timer = self.daemon.loop.later(self.backoff.next(), self.dial)

    def kick(self) -> None:
        if self.state == "waiting":
            self.dial()

    def close(self) -> None:
        self._cancel_timer()
        if self.sock is not None:
            self.daemon.loop.forget(self.sock)
            self.sock = None
        self.state = "closed"

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Daemon:
    def __init__(self, config_path: str | Path) -> None:
        self.config_path = os.fspath(config_path)
        self.config = load_config(self.config_path)
        self.loop = _Loop()
        self.peers: list[str] = []
        self.connected: set[str] = set()
        self._dialers: dict[str, _Dialer] = {}
        self._reloads = 0
        self._last_status = ""
        self._listeners: list[socket.socket] = []
        self.stopping = False

    @property
    def ready(self) -> bool:
        return all(p in self.connected for p in self.peers)

    def _say(self, line: str) -> None:
        sys.stdout.write(f"IMEX-SIM {line}\n")
        sys.stdout.flush()

    def report(self) -> None:
        status = "READY" if self.ready else "NOT_READY"
        line = f"STATUS {status} connected={len(set(self.peers) & self.connected)}/{len(self.peers)}"
        if line != self._last_status:
            self._last_status = line
            self._say(line)

    def _greet_peer(self, sock: socket.socket, line: bytes) -> bool:
        return line.startswith(HELLO) and _send(sock, WELCOME + b" " + self.config.bind_ip.encode() + b"\n")

    def _answer_cmd(self, sock: socket.socket, line: bytes) -> bool:
        if line.strip() == b"q":
            _send(sock, b"READY\n" if self.ready else b"NOT_READY\n")
        return False

    def _listen(self, port: int, on_line: Callable[[socket.socket, bytes], bool]) -> None:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((self.config.bind_ip, port))
            server.listen(128)
        except OSError:
            server.close()
            raise
        server.setblocking(False)

        def accept() -> None:
            with contextlib.suppress(BlockingIOError, ConnectionAbortedError):
                sock, _ = server.accept()
                sock.setblocking(False)
                _Greeted(self.loop, sock, on_line)

        self._listeners.append(server)
        self.loop.watch(server, selectors.EVENT_READ, accept)

    def _set_peers(self, peers: list[str]) -> None:
        for gone in set(self._dialers) - set(peers):
            self._dialers.pop(gone).close()
            self.connected.discard(gone)
        for peer in peers:
            if peer in self._dialers:
                self._dialers[peer].kick()  # redial now if it is waiting out a backoff
            else:
                self._dialers[peer] = _Dialer(self, peer)
        self.peers = peers
        self.report()

    def reload(self) -> None:
        try:
            self.config = load_config(self.config_path)
            peers = resolve_peers(self.config)
        except ImexConfigError as exc:
            self._say(f"ERROR {exc}")
            return
        self._reloads += 1
        self._set_peers(peers)  # reports a status change first, so RELOAD follows it
        self._say(f"RELOAD {self._reloads} peers={len(peers)}")

    def start(self) -> None:
        """Listen and dial (OSError when a port cannot be bound); `run_once()` then serves."""
        cfg = self.config
        peers = resolve_peers(cfg)
        self._listen(cfg.server_port, self._greet_peer)
        if cfg.cmd_enabled:
            self._listen(cfg.cmd_port, self._answer_cmd)
        self._say(f"LISTENING {cfg.bind_ip}:{cfg.server_port}")
        self._set_peers(peers)

    def close(self) -> None:
        for dialer in self._dialers.values():
            dialer.close()
        for server in self._listeners:
            self.loop.forget(server)
        self.loop.selector.close()


def _serve(config_path: str) -> int:
    """Run the daemon until SIGTERM or SIGINT; SIGHUP and SIGUSR1 reload it. A signal's handler only notes it:
    the wake-up socket ends the select() it interrupts, and the loop acts on it."""
    daemon = Daemon(config_path)
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    pending: list[int] = []
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, lambda signum, _frame: pending.append(signum))

    def signalled() -> None:
        with contextlib.suppress(BlockingIOError):
            wake_r.recv(4096)
        while pending:
            if pending.pop(0) in (signal.SIGTERM, signal.SIGINT):
                daemon.stopping = True
            else:
                daemon.reload()

    daemon.loop.watch(wake_r, selectors.EVENT_READ, signalled)
    try:
        daemon.start()
        while not daemon.stopping:
            daemon.loop.run_once()
    finally:
        daemon.close()
    return 0


async def query(config_path: str | Path, timeout: float = 2.0) -> str:
    import asyncio  # noqa: PLC0415 - only a query (and the tests awaiting it) pays for asyncio's import

    cfg = load_config(config_path)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(cfg.bind_ip, cfg.cmd_port), timeout)
    try:
        writer.write(b"q\n")
        await writer.drain()
        return (await asyncio.wait_for(reader.readline(), timeout)).decode().strip()
    finally:
        writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="imexd", description="simulated IMEX daemon (loopback TCP)")
    parser.add_argument("--config", "-c", required=True, help="the IMEX config file (imexd.cfg)")
    parser.add_argument("--query", "-q", action="store_true", help="ask the running daemon; prints READY")
    args = parser.parse_args(argv)
    try:
        if args.query:
            import asyncio  # noqa: PLC0415 - see query()

            answer = asyncio.run(query(args.config))
            print(answer)
            return 0 if answer == "READY" else 1
        return _serve(args.config)
    except ImexConfigError as exc:
        print(f"imexd: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"imexd: cannot listen or connect: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
