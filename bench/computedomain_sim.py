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

`ReadyGate` holds chosen nodes' daemons at their Ready (they run, so their peers turn Ready; their own
Ready is not reported) until it is opened: the bench's `--hold-last` brings every domain up but its last
daemon, lets the process settle, and opens the gate, so that "last daemon Ready -> all Ready" is timed from
daemons that turn Ready at once on a quiet control plane, not behind the backlog of 1,152 nodes' bring-up
simulated on two cores (which real nodes, each on its own CPUs, do not share).
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

from services.computedomain.imexd import ImexConfig, ImexConfigError, load_config, resolve_peers

_RUNNING: dict[str, InProcessDaemon] = {}  # bind address -> running daemon


class ReadyGate:
    """Nodes whose daemons' Ready waits for `open` (see the module doc); one per bench process."""

    def __init__(self) -> None:
        self.nodes: set[str] = set()
        self.waiting: set[str] = set()  # held nodes whose daemon is Ready and waits
        self.changed = asyncio.Event()  # set whenever `waiting` grows
        self._open = asyncio.Event()

    def hold(self, nodes: set[str]) -> None:
        self.nodes, self.waiting = set(nodes), set()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_turn(self, node: str) -> None:
        if node not in self.nodes or self._open.is_set():
            return
        self.waiting.add(node)
        self.changed.set()
        await self._open.wait()
        self.waiting.discard(node)


GATE = ReadyGate()
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
        self._config: ImexConfig | None = None
        self._resolved: tuple[tuple[str, str], list[str]] | None = None  # the files' texts and their peers

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
        """The config once (the agent writes it before the start), the peers at each start and reload."""
        try:
            if self._config is None:
                self._config = load_config(self.config)
                self.address = self._config.bind_ip
            # parsed again only when the nodes or hosts file's text changed: a peer's first Ready makes the agent
            # signal a reload with the same files (its redial), and 1,152 daemons' parsing in this one process is
            # time real daemons spend on their own nodes
            texts = (_text(self._config.nodes_file), _text(self._config.hosts_file))
            if self._resolved is None or self._resolved[0] != texts:
                self._resolved = (texts, resolve_peers(self._config))
            self.peers = list(self._resolved[1])
        except ImexConfigError:
            self.peers = []

    async def _report(self) -> None:
        while True:
            await self._check.wait()
            self._check.clear()
            ready = all(p in _RUNNING for p in self.peers)
            if ready and not self.ready:
                await GATE.wait_turn(self.name.rpartition("@")[2])
                ready = all(p in _RUNNING for p in self.peers)
            if ready != self.ready:
                self.ready = ready
                await self._on_ready(ready)


def _text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return "\0"  # missing: never equal to a text read


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
