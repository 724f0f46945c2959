"""Bench-only: computedomain_bench.py's simulated GB200 nodes, in the bench process or in node processes of their
own (`--node-processes`).

A node is discovery, the ComputeDomain agent (with its simulated IMEX daemon) and the channel preparer core, on
one bus connection per process. `LocalNodes` runs some domains' nodes in this process; `NodeProcess` runs them as
`python bench/computedomain_nodes.py --spec JSON`, whose LocalNodes takes the bench's commands as JSON lines on
stdin and answers on stdout. Real nodes run each on its own CPUs and connection: in node processes, the
controller and the bench's watches (in the bench process) no longer share one event loop and one NATS connection
with 1,152 nodes' agents, which is what the one-process bench measured at 64 x 18.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.computedomain_sim import GATE, InProcessDaemon  # noqa: E402
from bench.procstats import memory_mib  # noqa: E402
from embedded.harness.discovery import running_discovery  # noqa: E402
from services.computedomain.agent import Agent  # noqa: E402
from services.computedomain.channelcore import (  # noqa: E402
    ChannelClaim,
    ChannelNotReady,
    ChannelPreparer,
    channel_config,
    parse_channel_config,
)
from services.computedomain.config import AgentConfig  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.logs import setup_logging  # noqa: E402

NS = "bench"
# (logger, message) -> timeline mark: what the components already log, with the record's wall-clock time
LOGGED = {
    ("services.computedomain.membership", "joined compute domain"): "joined",
    ("services.computedomain.imex", "IMEX daemon started"): "spawned",
}


class Timeline(logging.Handler):
    """Wall-clock marks per (domain uid, node), first occurrence of each."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.marks: dict[tuple[str, str], dict[str, float]] = {}

    def mark(self, uid: str, node: str, what: str, at: float | None = None) -> None:
        self.marks.setdefault((uid, node), {}).setdefault(what, time.time() if at is None else at)

    def emit(self, record: logging.LogRecord) -> None:
        what = LOGGED.get((record.name, record.getMessage()))
        fields = getattr(record, "structured_fields", None) or {}
        if what == "joined":
            self.mark(fields["domain"], fields["node"], what, record.created)
        elif what == "spawned":
            uid, _, node = str(fields["daemon"]).rpartition("@")
            self.mark(uid, node, what, record.created)

    def install(self) -> None:
        """Take the INFO lines those loggers already write; the console handler keeps showing warnings only."""
        logging.getLogger().handlers[0].setLevel(logging.WARNING)
        for name, _msg in LOGGED:
            logging.getLogger(name).setLevel(logging.INFO)
            logging.getLogger(name).addHandler(self)


async def settle(quiet_ms: float = 5.0, needed: int = 20, limit_s: float = 60.0) -> float:
    """Wait until this process's event loop is quiet: `needed` successive 20 ms sleeps each overshooting by
    less than `quiet_ms` (or `limit_s` passes). Returns the median overshoot of the last `needed` sleeps, ms."""
    lags: list[float] = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = time.perf_counter()
        await asyncio.sleep(0.02)
        lags = [*lags[-(needed - 1) :], (time.perf_counter() - before - 0.02) * 1000]
        if len(lags) == needed and max(lags) < quiet_ms:
            break
    return round(statistics.median(lags), 2)


def node_name(d: int, i: int, many: bool) -> str:
    return f"gb200-{d:02d}-{i:02d}" if many else f"gb200-{i:02d}"


def node_address(d: int, i: int) -> str:
    return f"127.{99 + d // 250}.{d % 250}.{i + 1}"


@dataclass
class NodesSpec:
    """Which nodes a LocalNodes runs: domains `first` .. `first + count - 1`, `per` nodes each."""

    url: str
    root: str
    first: int
    count: int
    per: int
    daemon: str  # "subprocess" or "in-process"
    many: bool  # node names carry the domain (more than one domain)
    port: int  # the IMEX daemons' server port (the command port is the next)

    def names(self) -> list[str]:
        return [node_name(d, i, self.many) for d in range(self.first, self.first + self.count) for i in range(self.per)]


@dataclass
class RoundResult:
    """What a group of nodes reports after a round's prepares: timeline marks (uid, node, {phase: time}) and the
    nodes whose prepare was answered "not ready" and tried again."""

    marks: list[tuple[str, str, dict[str, float]]]
    retried: list[str]


class LocalNodes:
    """Some domains' nodes in this process, on `bus`."""

    def __init__(self, spec: NodesSpec, bus: Bus, tl: Timeline) -> None:
        self.spec, self.bus, self.tl = spec, bus, tl
        self.nodes = spec.names()
        self.preparers: dict[str, ChannelPreparer] = {}
        self.agents: list[Agent] = []
        self._stacks: list[contextlib.AsyncExitStack] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        spec, root = self.spec, Path(self.spec.root)
        for d in range(spec.first, spec.first + spec.count):
            # a domain's nodes' discovery at once (two cliques per domain): set-up is not measured
            opened = [contextlib.AsyncExitStack() for _ in range(spec.per)]
            self._stacks += opened
            await asyncio.gather(
                *(
                    opened[i].enter_async_context(
                        running_discovery(
                            self.bus,
                            node_name(d, i, spec.many),
                            simulate=f"gb200x4:clique={1 + (i * 2) // spec.per}",
                            root=root / "sim",
                            # what real nodes do on their own CPUs, not this process's: no utilisation samples,
                            # and the health thread's NVML wait at the service's 1 s (the harness's 100 ms is
                            # 11,520 wake-ups a second at 64 x 18 nodes)
                            telemetry_interval=0,
                            event_timeout_ms=1000,
                        )
                    )
                    for i in range(spec.per)
                )
            )
            for i in range(spec.per):
                node = node_name(d, i, spec.many)
                cfg = AgentConfig(
                    node=node,
                    ip_address=node_address(d, i),
                    state_dir=str(root / "agents" / node),
                    imex_server_port=spec.port,
                    imex_cmd_port=spec.port + 1,
                    imex_daemon="simulated",
                ).resolved()
                agent = Agent(cfg, self.bus, supervisor=InProcessDaemon if spec.daemon == "in-process" else None)
                self.agents.append(agent)
                self._tasks.append(asyncio.create_task(agent.run(self._stopping)))
                self.preparers[node] = ChannelPreparer(
                    self.bus,
                    node=node,
                    dev_root=str(root / "sim" / node),
                    ready_timeout=120,
                    request_timeout=120,
                    simulated=True,
                )
        await asyncio.gather(*(a.ready.wait() for a in self.agents))

    async def stop(self) -> None:
        self._stopping.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # all at once: one after another took 0.6 s a node
        await asyncio.gather(*(s.aclose() for s in self._stacks), return_exceptions=True)

    def hold(self, held: set[str]) -> None:
        """This round's held nodes (their daemons' Ready waits at the gate), of those here."""
        GATE.hold(held & set(self.nodes))

    async def gate_full(self) -> float:
        """Once every held node here waits at the gate: this loop's lag when it is quiet, ms."""
        while GATE.waiting != GATE.nodes:
            GATE.changed.clear()
            await asyncio.wait_for(GATE.changed.wait(), 600)
        return await settle()

    def open(self) -> None:
        GATE.open()

    async def prepare(self, uids: dict[str, str]) -> RoundResult:
        """One channel claim a node, all at once, as the kubelet would: `uids` maps each domain's name (its
        index last, `cd-<tag>-<d>`) to its uid."""
        by_index = {int(name.rpartition("-")[2]): (name, uid) for name, uid in uids.items()}
        retried: list[str] = []

        async def one(node: str, k: int) -> None:
            name, uid = by_index[self.spec.first + k // self.spec.per]
            i = k % self.spec.per
            p = self.preparers[node]
            self.tl.mark(uid, node, "prepare_called")
            cfg = parse_channel_config(channel_config(uid))
            for attempt in range(5):  # kubelet retries a prepare that answers "not ready" (backoff: 1 s, doubling)
                try:
                    await p.prepare(ChannelClaim(f"{name}-{i}", NS, f"{name}-{i}", cfg))
                    break
                except ChannelNotReady:
                    if attempt == 4:
                        raise
                    retried.append(node)
                    await asyncio.sleep(2**attempt)
            self.tl.mark(uid, node, "prepared")

        await asyncio.gather(*(one(node, k) for k, node in enumerate(self.nodes)))
        mine = set(uids.values())
        marks = [(u, n, m) for (u, n), m in self.tl.marks.items() if u in mine]
        return RoundResult(marks, retried)


class NodeProcess:
    """A LocalNodes in a process of its own (`python bench/computedomain_nodes.py --spec JSON`), same methods."""

    def __init__(self, spec: NodesSpec) -> None:
        self.spec = spec
        self.nodes = spec.names()
        self.proc: asyncio.subprocess.Process | None = None
        self._answers: dict[str, asyncio.Queue[Any]] = {k: asyncio.Queue() for k in ("started", "gate_full", "prepare")}
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--spec",
            json.dumps(asdict(self.spec)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=64 << 20,  # a round's marks come as one line
        )
        self._reader = asyncio.create_task(self._read())
        await self._answer("started")

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            kind, value = json.loads(line)
            self._answers[kind].put_nowait(value)
        for queue in self._answers.values():  # the process ended: every waiter learns it
            queue.put_nowait(RuntimeError(f"node process {self.spec.first} exited {await self.proc.wait()}"))

    async def _answer(self, kind: str) -> Any:
        value = await self._answers[kind].get()
        if isinstance(value, RuntimeError):
            raise value
        if isinstance(value, dict):
            raise RuntimeError(f"node process {self.spec.first}: {kind} failed: {value['error']}")
        return value

    def _tell(self, *command: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self._tell("stop")
        await self.proc.wait()
        if self._reader is not None:
            await self._reader

    def hold(self, held: set[str]) -> None:
        self._tell("hold", sorted(held & set(self.nodes)))

    async def gate_full(self) -> float:
        self._tell("gate_full")
        return float(await self._answer("gate_full"))

    def open(self) -> None:
        self._tell("open")

    async def prepare(self, uids: dict[str, str]) -> RoundResult:
        self._tell("prepare", uids)
        marks, retried = await self._answer("prepare")
        return RoundResult([(u, n, m) for u, n, m in marks], retried)

    def rss_mib(self) -> float:
        assert self.proc is not None
        return memory_mib(self.proc.pid)[0]


async def serve(spec: NodesSpec) -> None:
    """A node process: run the nodes, take the bench's commands from stdin, answer ["kind", value] lines."""
    tl = Timeline()
    tl.install()
    bus = await Bus.connect(spec.url, name=f"bench-nodes-{spec.first}")
    nodes = LocalNodes(spec, bus, tl)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader(limit=64 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

    def answer(kind: str, value: Any) -> None:
        sys.stdout.write(json.dumps([kind, value]) + "\n")
        sys.stdout.flush()

    async def answered(kind: str, work: Any) -> None:
        try:
            result = await work
        except Exception as exc:  # noqa: BLE001 - the bench raises it: a round that failed must not wait forever
            answer(kind, {"error": repr(exc)})
            return
        answer(kind, [result.marks, result.retried] if isinstance(result, RoundResult) else result)

    pending: set[asyncio.Task[None]] = set()
    try:
        await nodes.start()
        answer("started", len(nodes.nodes))
        while line := await stdin.readline():
            command, *args = json.loads(line)
            if command == "stop":
                break
            if command == "hold":
                nodes.hold(set(args[0]))
            elif command == "open":
                nodes.open()
            elif command in ("gate_full", "prepare"):
                work = nodes.gate_full() if command == "gate_full" else nodes.prepare(args[0])
                task = asyncio.create_task(answered(command, work))
                pending.add(task)
                task.add_done_callback(pending.discard)
    finally:
        for task in pending:
            task.cancel()
        await nodes.stop()
        await bus.close()


def main() -> int:
    parser = argparse.ArgumentParser(description="a node process of computedomain_bench.py")
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    setup_logging("bench-nodes", "warning")
    asyncio.run(serve(NodesSpec(**json.loads(args.spec))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
