"""The files an IMEX daemon reads, for one domain on one node: `imexd.cfg`, `nodes.cfg`, the hosts entries.

Owns their layout under `<state-dir>/domains/<domain-uid>/` and how peers are written (facts from
NVIDIA's compute-domain daemon). `imexd.cfg` names `IMEX_NODE_CONFIG_FILE` and `SERVER_PORT`; only
the simulated daemon's config also names its own hosts file (`IMEX_SIM_HOSTS_FILE`). Two peer modes:
  dns  `nodes.cfg` statically lists `compute-domain-daemon-0000` .. `-<max-1>`, and the peers are made
       known by a marked block of `<ip>\\t<name>` lines (one per same-clique member, by its index) in
       the hosts file the daemon resolves names with; the daemon is then signalled to redial. A peer's
       new IP needs no restart.
  ip   `nodes.cfg` lists the same-clique members' IPs in index order; the daemon is restarted on change.
Writes are skipped when unchanged. Files of our own are replaced atomically (temp file + rename); the
shared hosts file (the container's `/etc/hosts`, a bind mount that a rename cannot replace) is
rewritten in place, keeping every line outside our block. Blocking: call via to_thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DNS_NAME = "compute-domain-daemon-{index:04d}"
BLOCK_BEGIN = "# gpu-dra computedomain: begin"
BLOCK_END = "# gpu-dra computedomain: end"

PeerMode = Literal["dns", "ip"]


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
        """The simulated daemon's own hosts file (the real one resolves through the container's)."""
        return self.directory / "hosts"

    @property
    def log(self) -> Path:
        return self.directory / "imexd.log"

    @property
    def pid(self) -> Path:
        """The running daemon's record (see services.computedomain.orphans)."""
        return self.directory / "imexd.pid"


def _write(path: Path, text: str) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def write_static(
    files: DaemonFiles,
    *,
    bind_ip: str,
    server_port: int,
    cmd_port: int,
    max_nodes: int,
    peer_mode: PeerMode = "dns",
    sim_hosts: Path | None = None,
) -> None:
    """imexd.cfg (and, in dns mode, the static nodes.cfg), written once per daemon start.

    `sim_hosts`: the simulated daemon's hosts file, named in the config by a key only it reads."""
    lines = [
        "# written by gpu-dra computedomain agent",
        f"IMEX_CMD_BIND_INTERFACE_IP={bind_ip}",
        f"IMEX_NODE_CONFIG_FILE={files.nodes}",
        f"SERVER_PORT={server_port}",
        f"IMEX_CMD_PORT={cmd_port}",
        "IMEX_CMD_ENABLED=1",
        "IMEX_WAIT_FOR_QUORUM=RECOVERY",
        "IMEX_ENABLE_AUTH_ENCRYPTION=0",
        "DAEMONIZE=0",
        "LOG_FILE_NAME=",
        "IMEX_NODE_DISCONNECTED_GRACE_TIME=-1",
    ]
    if sim_hosts is not None:
        lines.append(f"IMEX_SIM_HOSTS_FILE={sim_hosts}")
    _write(files.config, "\n".join([*lines, ""]))
    if peer_mode == "dns":
        _write(files.nodes, "".join(dns_name(i) + "\n" for i in range(max_nodes)))
    elif not files.nodes.exists():
        _write(files.nodes, "")


def write_peers(files: DaemonFiles, peers: dict[int, str], *, peer_mode: PeerMode, hosts_file: Path) -> bool:
    """Make `peers` (DNS index -> IP, this node included) known to the daemon; True when a file changed.

    dns: our block in `hosts_file`; ip: the IPs in index order in nodes.cfg."""
    if peer_mode == "ip":
        return _write(files.nodes, "".join(f"{ip}\n" for _index, ip in sorted(peers.items())))
    return write_hosts_block(hosts_file, [f"{ip}\t{dns_name(index)}" for index, ip in sorted(peers.items())])


def _without_block(text: str) -> list[str]:
    kept: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.strip() == BLOCK_BEGIN:
            inside = True
        elif line.strip() == BLOCK_END and inside:
            inside = False
        elif not inside:
            kept.append(line)
    return kept


def write_hosts_block(path: Path, entries: list[str]) -> bool:
    """Replace our marked block in the hosts file `path` by `entries` (none: remove the block); True when
    it changed. Lines outside the block are kept as they are. In place: `/etc/hosts` is a bind mount."""
    try:
        current = path.read_text()
    except FileNotFoundError:
        if not entries:
            return False
        current = ""
    kept = _without_block(current)
    block = [BLOCK_BEGIN, *entries, BLOCK_END] if entries else []
    text = "".join(line + "\n" for line in [*kept, *block])
    if text == current:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:  # truncated and rewritten, never replaced by a rename
        f.write(text)
    return True


def clear_hosts_block(path: Path) -> bool:
    """Remove our block from the hosts file `path` (the node serves no domain any more)."""
    return write_hosts_block(path, [])
