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
Standard library only (and `shared.backoff`, which imports nothing), so that eighteen of them start quickly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.backoff import Backoff

HELLO = b"IMEX-SIM HELLO"
WELCOME = b"IMEX-SIM WELCOME"


class ImexConfigError(ValueError):
    """The config or nodes file is missing or malformed."""


@dataclass
class ImexConfig:
    bind_ip: str
    server_port: int
    cmd_port: int
    cmd_enabled: bool
    nodes_file: Path
    hosts_file: Path


def _parse_kv(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ImexConfigError(f"cannot read IMEX config {path}: {exc.strerror}") from None
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ImexConfigError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip()
    return values


def _int(values: dict[str, str], key: str, default: int, path: Path) -> int:
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


def load_config(path: Path) -> ImexConfig:
    values = _parse_kv(path)
    nodes = values.get("IMEX_NODE_CONFIG_FILE", "")
    if not nodes:
        raise ImexConfigError(f"{path}: IMEX_NODE_CONFIG_FILE is not set; it names the nodes config")
    bind_ip = values.get("IMEX_CMD_BIND_INTERFACE_IP") or values.get("IMEX_BIND_INTERFACE_IP") or "127.0.0.1"
    try:
        ipaddress.ip_address(bind_ip)
    except ValueError:
        raise ImexConfigError(f"{path}: bind address {bind_ip!r} is not an IP address") from None
    nodes_path = Path(nodes) if Path(nodes).is_absolute() else path.parent / nodes
    hosts = values.get("IMEX_SIM_HOSTS_FILE", "/etc/hosts")
    hosts_path = Path(hosts) if Path(hosts).is_absolute() else path.parent / hosts
    return ImexConfig(
        bind_ip=bind_ip,
        server_port=_int(values, "SERVER_PORT", 50000, path),
        cmd_port=_int(values, "IMEX_CMD_PORT", 50005, path),
        cmd_enabled=values.get("IMEX_CMD_ENABLED", "1") not in ("0", "false", "False"),
        nodes_file=nodes_path,
        hosts_file=hosts_path,
    )


def read_hosts(path: Path) -> dict[str, str]:
    """name -> address from an /etc/hosts-style file (missing file: nothing resolves)."""
    names: dict[str, str] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return names
    for line in text.splitlines():
        line = line.split("#", 1)[0].split()  # type: ignore[assignment]
        if len(line) >= 2:
            for name in line[1:]:
                names.setdefault(name, line[0])
    return names


def resolve_peers(config: ImexConfig) -> list[str]:
    """The peers' addresses: nodes-file entries that are IPs or resolve in the hosts file, minus self."""
    try:
        entries = [ln.strip() for ln in config.nodes_file.read_text().splitlines()]
    except OSError as exc:
        raise ImexConfigError(f"cannot read IMEX nodes config {config.nodes_file}: {exc.strerror}") from None
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


class Daemon:
    def __init__(self, config_path: Path) -> None:
        self.config_path = config_path
        self.config = load_config(config_path)
        self.peers: list[str] = []
        self.connected: set[str] = set()
        self._dialers: dict[str, asyncio.Task[None]] = {}
        self._kick: dict[str, asyncio.Event] = {}
        self._reloads = 0
        self._last_status = ""
        self._servers: list[asyncio.Server] = []
        self._inbound: set[asyncio.StreamWriter] = set()

    @property
    def ready(self) -> bool:
        return all(p in self.connected for p in self.peers)

    def _say(self, line: str) -> None:
        sys.stdout.write(f"IMEX-SIM {line}\n")
        sys.stdout.flush()

    def _report(self) -> None:
        status = "READY" if self.ready else "NOT_READY"
        line = f"STATUS {status} connected={len(set(self.peers) & self.connected)}/{len(self.peers)}"
        if line != self._last_status:
            self._last_status = line
            self._say(line)

    async def _serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._inbound.add(writer)
        try:
            hello = await asyncio.wait_for(reader.readline(), 5.0)
            if not hello.startswith(HELLO):
                return
            writer.write(WELCOME + b" " + self.config.bind_ip.encode() + b"\n")
            await writer.drain()
            while await reader.read(4096):
                pass
        except (OSError, TimeoutError):
            pass
        finally:
            self._inbound.discard(writer)
            writer.close()

    async def _serve_cmd(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            if line.strip() == b"q":
                writer.write(b"READY\n" if self.ready else b"NOT_READY\n")
                await writer.drain()
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()

    async def _dial(self, peer: str) -> None:
        backoff = Backoff(initial_s=0.02, cap_s=1.0)
        kick = self._kick[peer]
        while True:
            kick.clear()
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(peer, self.config.server_port, local_addr=(self.config.bind_ip, 0)), 2.0
                )
            except (OSError, TimeoutError):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(kick.wait(), backoff.next())
                continue
            try:
                writer.write(HELLO + b" " + self.config.bind_ip.encode() + b"\n")
                await writer.drain()
                answer = await asyncio.wait_for(reader.readline(), 2.0)
                if answer.startswith(WELCOME):
                    backoff.reset()
                    self.connected.add(peer)
                    self._report()
                    while await reader.read(4096):
                        pass
            except (OSError, TimeoutError):
                pass
            finally:
                self.connected.discard(peer)
                writer.close()
                self._report()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(kick.wait(), backoff.next())

    def _set_peers(self, peers: list[str]) -> None:
        for gone in set(self._dialers) - set(peers):
            self._dialers.pop(gone).cancel()
            self._kick.pop(gone, None)
            self.connected.discard(gone)
        for peer in peers:
            if peer not in self._dialers:
                self._kick[peer] = asyncio.Event()
                self._dialers[peer] = asyncio.create_task(self._dial(peer))
            else:
                self._kick[peer].set()  # redial now if it is waiting out a backoff
        self.peers = peers
        self._report()

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

    async def run(self, stopping: asyncio.Event) -> None:
        cfg = self.config
        peers = resolve_peers(cfg)
        self._servers.append(await asyncio.start_server(self._serve_peer, cfg.bind_ip, cfg.server_port))
        if cfg.cmd_enabled:
            self._servers.append(await asyncio.start_server(self._serve_cmd, cfg.bind_ip, cfg.cmd_port))
        self._say(f"LISTENING {cfg.bind_ip}:{cfg.server_port}")
        self._set_peers(peers)
        try:
            await stopping.wait()
        finally:
            for task in self._dialers.values():
                task.cancel()
            for server in self._servers:
                server.close()
            for writer in list(self._inbound):
                writer.close()


async def query(config_path: Path, timeout: float = 2.0) -> str:
    cfg = load_config(config_path)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(cfg.bind_ip, cfg.cmd_port), timeout)
    try:
        writer.write(b"q\n")
        await writer.drain()
        return (await asyncio.wait_for(reader.readline(), timeout)).decode().strip()
    finally:
        writer.close()


async def _main(config_path: Path) -> int:
    daemon = Daemon(config_path)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    for sig in (signal.SIGHUP, signal.SIGUSR1):
        loop.add_signal_handler(sig, daemon.reload)
    await daemon.run(stopping)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="imexd", description="simulated IMEX daemon (loopback TCP)")
    parser.add_argument("--config", "-c", required=True, help="the IMEX config file (imexd.cfg)")
    parser.add_argument("--query", "-q", action="store_true", help="ask the running daemon; prints READY")
    args = parser.parse_args(argv)
    try:
        if args.query:
            answer = asyncio.run(query(Path(args.config)))
            print(answer)
            return 0 if answer == "READY" else 1
        return asyncio.run(_main(Path(args.config)))
    except ImexConfigError as exc:
        print(f"imexd: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"imexd: cannot listen or connect: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
