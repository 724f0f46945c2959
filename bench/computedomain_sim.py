"""Bench-only helpers for computedomain_bench.py: an in-process simulated IMEX daemon, and the simulated
daemon's own start-up time.

`InProcessDaemon` stands in for ImexSupervisor (Agent(..., supervisor=InProcessDaemon)) when the bench
runs more nodes than this machine can hold daemon processes for (64 x 18 = 1152 Python processes: about
20 GB and 40,000 sockets). It reads the same files with the simulator's own parsers (imexd.load_config,
imexd.resolve_peers) but opens no sockets: a daemon is Ready when every peer it resolved is running in
this process (a registry by address), re-checked on its reload signal and whenever a daemon starts or
stops. So its Ready is earlier than a real connection's; what it measures is the control plane
downstream of daemon readiness (membership -> controller -> status), which does not depend on how a
daemon runs.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from services.computedomain.imexd import ImexConfigError, load_config, resolve_peers

_RUNNING: dict[str, InProcessDaemon] = {}  # bind address -> running daemon
_REPO = Path(__file__).resolve().parents[1]


class InProcessDaemon:
    """The DaemonSupervisor protocol over an in-process, socket-less daemon (see the module doc)."""

    def __init__(self, *, name: str, config: Path, on_ready: Callable[[bool], Awaitable[None]], **_: Any) -> None:
        self.name = name
        self.config = config
        self._on_ready = on_ready
        self.ready = False
        self.address = ""
        self.peers: list[str] = []
        self._check = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._read()
        _RUNNING[self.address] = self
        self._task = asyncio.create_task(self._report(), name=f"sim-imex-{self.name}")
        _everyone_check()

    async def stop(self) -> None:
        if _RUNNING.get(self.address) is self:
            del _RUNNING[self.address]
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self.ready:
            self.ready = False
            await self._on_ready(False)
        _everyone_check()

    def reload(self) -> None:
        self._read()
        self._check.set()

    def restart(self) -> None:
        self.reload()

    def _read(self) -> None:
        try:
            cfg = load_config(self.config)
            self.address, self.peers = cfg.bind_ip, resolve_peers(cfg)
        except ImexConfigError:
            self.peers = []

    async def _report(self) -> None:
        while True:
            await self._check.wait()
            self._check.clear()
            ready = all(p in _RUNNING for p in self.peers)
            if ready != self.ready:
                self.ready = ready
                await self._on_ready(ready)


def _everyone_check() -> None:
    for daemon in _RUNNING.values():
        daemon._check.set()


async def daemon_startup_ms(count: int) -> dict[str, float]:
    """Wall time for `count` simulated daemons (`python -m services.computedomain.imexd`) started at once to
    have imported and parsed their config (each exits at its first bind: the bench holds the port): the Python
    start-up that a real, C nvidia-imex does not pay. Also one alone."""
    with tempfile.TemporaryDirectory(prefix="imexd-start-") as tmp, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        cfg = Path(tmp) / "imexd.cfg"
        cfg.write_text(
            f"IMEX_NODE_CONFIG_FILE={tmp}/nodes\nIMEX_CMD_BIND_INTERFACE_IP=127.0.0.1\n"
            f"SERVER_PORT={taken.getsockname()[1]}\n"
        )
        (Path(tmp) / "nodes").write_text("127.0.0.1\n")

        async def one() -> None:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "services.computedomain.imexd",
                "--config",
                str(cfg),
                cwd=_REPO,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            assert await proc.wait() == 3, "the daemon should have stopped at its bind"

        figures = {}
        for label, n in (("one_ms", 1), (f"{count}_at_once_ms", count)):
            start = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(n)))
            figures[label] = round((time.perf_counter() - start) * 1000, 1)
        return figures
