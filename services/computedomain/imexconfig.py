"""The files an IMEX daemon reads, for one domain on one node: `imexd.cfg`, `nodes.cfg`, `hosts`.

Owns their layout under `<state-dir>/domains/<domain-uid>/`. DNS-name mode as the upstream driver
runs it: `nodes.cfg` statically lists `compute-domain-daemon-0000` .. `-<max-1>`, and the peers are
made known by rewriting `hosts` (`<ip>\\t<name>` per same-clique member, by its index); the daemon is
then signalled to re-resolve. Writes are atomic (temp file + rename) and skipped when unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DNS_NAME = "compute-domain-daemon-{index:04d}"


def dns_name(index: int) -> str:
    return DNS_NAME.format(index=index)


@dataclass(frozen=True)
class DaemonFiles:
    directory: Path

    @property
    def config(self) -> Path:
        return self.directory / "imexd.cfg"

    @property
    def nodes(self) -> Path:
        return self.directory / "nodes.cfg"

    @property
    def hosts(self) -> Path:
        return self.directory / "hosts"

    @property
    def log(self) -> Path:
        return self.directory / "imexd.log"


def _write(path: Path, text: str) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def write_static(files: DaemonFiles, *, bind_ip: str, server_port: int, cmd_port: int, max_nodes: int) -> None:
    """imexd.cfg and nodes.cfg, written once per daemon start (blocking; call via to_thread)."""
    _write(files.config, "\n".join([
        "# written by gpu-dra computedomain agent",
        f"IMEX_CMD_BIND_INTERFACE_IP={bind_ip}",
        f"IMEX_NODE_CONFIG_FILE={files.nodes}",
        f"IMEX_SIM_HOSTS_FILE={files.hosts}",
        f"SERVER_PORT={server_port}",
        f"IMEX_CMD_PORT={cmd_port}",
        "IMEX_CMD_ENABLED=1",
        "IMEX_WAIT_FOR_QUORUM=RECOVERY",
        "IMEX_ENABLE_AUTH_ENCRYPTION=0",
        "DAEMONIZE=0",
        "LOG_FILE_NAME=",
        "IMEX_NODE_DISCONNECTED_GRACE_TIME=-1",
        "",
    ]))
    _write(files.nodes, "".join(dns_name(i) + "\n" for i in range(max_nodes)))
    if not files.hosts.exists():
        _write(files.hosts, "")


def write_hosts(files: DaemonFiles, peers: dict[int, str]) -> bool:
    """The hosts file for `peers` (index -> IP); True when it changed."""
    lines = [f"{ip}\t{dns_name(index)}\n" for index, ip in sorted(peers.items())]
    return _write(files.hosts, "".join(lines))
