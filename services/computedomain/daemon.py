"""Which IMEX daemon the agent runs, and how: the real `nvidia-imex` from the driver root, or the simulator.

Owns the choice made once at agent start from the settings. Real (the default): `nvidia-imex -c
{config}` and readiness by `nvidia-imex-ctl -c {config} -q` printing READY, both found in the driver
root's binary dirs and run with the driver's own libraries first (links by SONAME in
`<state-dir>/driver-lib`: the root's library dirs also hold its libc, which must not be loaded
by this container's dynamic loader); reload signal SIGUSR1 (nvidia-imex's "restart the
connections", handled once per 5 s; SIGHUP only dumps its log buffer); peers through the hosts file
the daemon resolves with (`--hosts-file`, the container's /etc/hosts). Simulated (`--imex-daemon
simulated`, what `gpu-dra up` asks for): `python -m services.computedomain.imexd`, readiness from its
status lines, and a hosts file of its own per domain (named in its config), so that many simulated
nodes share one machine. `--imex-command` / `--imex-check-command` replace the command in either.
A real daemon that is missing is not an error at start (a node without NVLink fabric never runs it)
but a warning, and a clear error for the first channel claim that needs it.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from services.computedomain.config import AgentConfig
from services.computedomain.imexconfig import DaemonFiles
from shared.driverroot import BINARY_DIRS
from shared.drivertools import DriverTools, ToolError

SIMULATOR_COMMAND = f"{shlex.quote(sys.executable)} -m services.computedomain.imexd --config {{config}}"


@dataclass(frozen=True)
class DaemonLaunch:
    command: str
    check_command: str
    reload_signal: str
    signal_spacing: float
    simulated: bool
    hosts_file: Path | None  # the real daemon's; None: each domain's own (the simulator)
    env: dict[str, str] = field(default_factory=dict)
    problem: str = ""  # why no daemon can run on this node; "" when one can

    def hosts_for(self, files: DaemonFiles) -> Path:
        """The hosts file the domain's daemon resolves peer names with."""
        return self.hosts_file or files.hosts


def resolve_launch(cfg: AgentConfig) -> DaemonLaunch:
    """The daemon for these settings (blocking: looks in the driver root; call via to_thread)."""
    if cfg.imex_daemon == "simulated":
        return DaemonLaunch(
            command=cfg.imex_command or SIMULATOR_COMMAND,
            check_command=cfg.imex_check_command,
            reload_signal=cfg.imex_reload_signal,
            signal_spacing=0.0,
            simulated=True,
            hosts_file=None,
        )
    tools = DriverTools.of(cfg.driver_root, cfg.container_driver_root)
    root = tools.root
    missing: list[str] = []
    env: dict[str, str] = {}

    def command(setting: str, binary: str, *args: str) -> str:
        if setting:
            return setting
        try:
            prefix, tool_env = tools.command(binary)
        except ToolError:
            missing.append(binary)
            return ""
        env.update(tool_env)
        return shlex.join([*prefix, *args])

    daemon = command(cfg.imex_command, "nvidia-imex", "-c", "{config}")
    check = command(cfg.imex_check_command, "nvidia-imex-ctl", "-c", "{config}", "-q")
    problem = ""
    if missing:
        problem = (
            f"no {' or '.join(missing)} under driver root {root.local('/')} (looked in "
            f"{', '.join(BINARY_DIRS)}); install the driver's IMEX package on the node (nvidia-imex of "
            "the driver's branch), set --driver-root (host) and --container-driver-root (where this "
            "container mounts it), or name the daemon with --imex-command"
        )
    return DaemonLaunch(
        command=daemon,
        check_command=check,
        reload_signal=cfg.imex_reload_signal,
        signal_spacing=cfg.imex_signal_spacing,
        simulated=False,
        hosts_file=Path(cfg.hosts_file) if cfg.imex_peer_mode == "dns" else None,
        env=env,
        problem=problem,
    )
