"""Events bench (issue 33): claim events fanned out through JetStream to independent third-party consumers.

A nats-server run as `gpu-dra up` runs it (shared.natsserver with the operator/account config and .creds that
embedded.cluster.natsidentities issues, `Bus.provision()` making DRA_EVENTS with the catalog's limits);
`--publishers` processes (default 2, splitting the rate), each speaking for `--nodes-per-publisher` nodes
(default 8; a fleet's nodes are processes of their own, and one process for all 16 runs their senders' rounds
and acks on one event loop, which at 10,000/s is the first thing to fill up), minting real claim lifecycle
events through the preparer's own path (services.preparer.host.lifecycle: `LifecycleEvents.make()`, its
in-memory outbox and sender; the `ClaimLifecycle` with one prepared GPU, CloudEvents headers, `traceparent`
of the claim's trace, `Nats-Msg-Id` of event id and process suffix), paced at `--rate` for `--seconds`; and
one process per consumer (bench/events_consumer.py: a third party's durable pull consumer, batched fetch,
explicit acks, as its own `reader.<name>` identity), one of them slow (`--slow-rate` messages/s). The
publishers connect as the admin: a preparer's events go through the state gate, whose per-node share
(64 KiB/s) is far below 10,000 events/s from one process (docs/security.md).

Figures: the achieved publish rate (an event is made on time or skipped, see publish()); per consumer p50/p99
latency to delivery from the event's `observed_at` (through the outbox) and from the stream's timestamp
(stored → delivered), missing and duplicate events; the slow consumer's lag (events not yet acked) when the
publisher stopped and how long it took to drain after; stream bytes; CPU of nats-server and of each process;
the 1-minute load average. Then `--compare-seconds` runs at `--compare-rate` (one this machine sustains), with
and without the slow consumer, alternating twice, for the fast consumers' latency on their own; and a run with
DRA_EVENTS shrunk to `--evict-bytes`, where the slow consumer loses what the stream evicts before it reads it.

Run: `.venv/bin/python bench/events_bench.py [--seconds 60] [--rate 10000] [--slow-rate 1000]
[--publishers 2] [--nodes-per-publisher 8] [--consumer-mode pull|push] [--compare-seconds 15]
[--compare-rate 2500] [--evict-bytes 8388608] [--out bench/results/events.json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.events_consumer import ConsumerSpec, consume  # noqa: E402
from bench.procstats import cpu_s  # noqa: E402
from embedded.cluster.natsidentities import ADMIN, issue_identities  # noqa: E402
from services.preparer.host.lifecycle import SEND_WINDOW, LifecycleEvents  # noqa: E402
from shared.bus import Bus, NatsTLS  # noqa: E402
from shared.events.catalog import CLAIM, EVENTS_STREAM  # noqa: E402
from shared.events.claims import PreparedDeviceRef  # noqa: E402
from shared.heap import freeze_start_up  # noqa: E402
from shared.natsserver import EmbeddedNats  # noqa: E402
from shared.natsusers import reader_durable  # noqa: E402

NAMESPACE = "team-a"
DRIVER = "gpu.nvidia.com"
PUBLISHERS = 2  # publisher processes: the fleet's side uses both cores, as many nodes' processes would
NODES_PER_PUBLISHER = 8  # one LifecycleEvents (outbox and sender) per node, as on a real node
TICK_S = 0.005
READY, RESULT = "READY", "RESULT "


@dataclasses.dataclass(frozen=True)
class PublisherSpec:
    url: str
    creds: str
    nodes: list[str]
    rate: float
    seconds: float


def _device(node: str, uid: str, n: int) -> PreparedDeviceRef:
    gpu = f"gpu-{n % 8}"
    return PreparedDeviceRef(
        request="gpu",
        pool=node,
        device=gpu,
        uuid=f"GPU-{uid[:8]}-{uid[8:12]}-{uid[12:16]}-{uid[16:20]}-{uid[20:32]}",
        cdi_device_ids=[f"k8s.gpu.nvidia.com/claim={uid}-{gpu}"],
    )


async def publish(spec: PublisherSpec, ready: Callable[[], None], _total: object = None) -> dict[str, Any]:
    """Mint prepared events at `spec.rate`/s for `spec.seconds` through the preparer's outbox and sender. An
    event is made on time or not at all: while the senders have `backlog_cap` events not yet stored (each node's
    SEND_WINDOW: what its sender may have in flight), the events due
    are skipped (counted), so the achieved rate is what this process and the server sustain, and an event's
    latency is its own, not that of a queue in front of it."""
    bus = await Bus.connect(spec.url, name=f"bench-{spec.nodes[0]}", user=ADMIN, tls=NatsTLS(creds_file=spec.creds))
    senders = [LifecycleEvents(node, DRIVER) for node in spec.nodes]
    tasks = [asyncio.create_task(sender.run()) for sender in senders]
    for sender in senders:
        sender.attach(bus)
    cpu0 = _cpu()
    ready()
    loop = asyncio.get_running_loop()
    start, made, skipped, backlog = loop.time(), 0, 0, 0
    backlog_cap = len(senders) * SEND_WINDOW  # events made and not yet stored, at most
    uids = random.Random()  # seeded from the OS: each publisher process its own claims
    while (now := loop.time()) - start < spec.seconds:
        pending = sum(len(s.outbox.pending) for s in senders)
        backlog = max(backlog, pending)
        due = int((now - start) * spec.rate) + 1 - made - skipped
        room = max(0, min(due, backlog_cap - pending))
        skipped += due - room
        batches: list[list[Any]] = [[] for _ in senders]
        for n in range(made, made + room):
            sender = senders[n % len(senders)]
            uid = f"{uids.getrandbits(128):032x}"  # a claim's uid (the API server's; no secret)
            record = sender.make(
                "prepared",
                uid=uid,
                namespace=NAMESPACE,
                name=f"train-{uid[:5]}-gpu-claim-{uid[5:10]}",
                preparation=n,
                devices=[_device(sender.node, uid, n)],
            )
            record.traceparent = f"00-{uid}-{uid[:16]}-01"  # the claim's prepare span, as the preparer keeps it
            batches[n % len(senders)].append(record)
        for sender, records in zip(senders, batches, strict=True):
            if records:
                await sender.outbox.add(records)
        made += room
        await asyncio.sleep(TICK_S)
    paced_s = loop.time() - start
    await asyncio.gather(*(sender.drained() for sender in senders))
    stored_s = loop.time() - start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await bus.close()
    return {
        "made": made,
        "skipped": skipped,
        "stored": sum(s.sent for s in senders),
        "dropped": sum(s.dropped for s in senders),
        "paced_s": round(paced_s, 2),
        "stored_s": round(stored_s, 2),
        "outbox_backlog_max": backlog,
        "ended_at": time.time(),
        "cpu_s": round(_cpu() - cpu0, 2),
    }


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


# ---- running a role in-process (the suite) or as a process of its own (the bench) ---------------------------

Role = Callable[..., Coroutine[Any, Any, dict[str, Any]]]  # (spec, ready, total, **in-process extras)
ROLES: dict[str, tuple[Role, type]] = {"publisher": (publish, PublisherSpec), "consumer": (consume, ConsumerSpec)}


class Running:
    """A role started in this loop (`processes` False) or as `python bench/events_bench.py --role ...`; `tell()`
    hands a consumer the number of events published, once the publishers are done."""

    def __init__(self, role: str, spec: Any, processes: bool, gate: asyncio.Event | None = None) -> None:
        self.role, self.spec, self.processes = role, spec, processes
        self.gate = gate  # in-process only: consume()'s
        self.ready = asyncio.Event()
        self.total: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[dict[str, Any]] | None = None

    async def start(self) -> None:
        if self.processes:
            self._task = asyncio.create_task(self._child())
        else:
            extra = {"gate": self.gate} if self.gate is not None else {}
            self._task = asyncio.create_task(ROLES[self.role][0](self.spec, self.ready.set, self.total, **extra))
        ready = asyncio.create_task(self.ready.wait())
        await asyncio.wait([ready, self._task], return_when=asyncio.FIRST_COMPLETED)
        if not self.ready.is_set():
            ready.cancel()
            await self._task  # raises what stopped it

    def tell(self, total: int) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.write(f"{total}\n".encode())
        self.total.set_result(total)

    async def result(self) -> dict[str, Any]:
        assert self._task is not None
        return await self._task

    async def _child(self) -> dict[str, Any]:
        spec = json.dumps(dataclasses.asdict(self.spec))
        self._proc = proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--role",
            self.role,
            "--spec",
            spec,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        result: dict[str, Any] | None = None
        async for line in proc.stdout:
            text = line.decode().strip()
            if text == READY:
                self.ready.set()
            elif text.startswith(RESULT):
                result = json.loads(text[len(RESULT) :])
        if await proc.wait() != 0 or result is None:
            raise RuntimeError(f"{self.role} process exited {proc.returncode} without a result")
        return result


async def _as_child(role: str, spec_json: str) -> dict[str, Any]:
    """A role in this process: the total comes as a line on stdin."""
    func, spec_type = ROLES[role]
    loop = asyncio.get_running_loop()
    total: asyncio.Future[int] = loop.create_future()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

    async def told() -> None:
        total.set_result(int(await stdin.readline()))

    telling = asyncio.create_task(told())
    try:
        return await func(spec_type(**json.loads(spec_json)), lambda: print(READY, flush=True), total)
    finally:
        telling.cancel()


# ---- the run ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunSpec:
    seconds: float
    rate: float
    fast: int = 2  # fast consumers
    slow_rate: float = 0.0  # > 0: one more consumer, processing this many events a second
    publishers: int = PUBLISHERS
    nodes_per_publisher: int = NODES_PER_PUBLISHER  # the fleet's nodes each publisher process speaks for
    processes: bool = True  # each role a process of its own (the bench); False: tasks of this loop (the suite)
    give_up_s: float = 30.0
    stream_max_bytes: int = 0  # > 0: DRA_EVENTS' limit made this (what eviction costs a slow consumer)
    consumer_mode: str = "pull"  # how the consumers take delivery: pull (fetch) or push (docs/events.md)

    @property
    def names(self) -> list[str]:
        return [f"fast{i + 1}" for i in range(self.fast)] + (["slow"] if self.slow_rate else [])


async def run(spec: RunSpec, *, slow_gate: asyncio.Event | None = None) -> dict[str, Any]:
    """One run on a server of its own. `slow_gate` (in-process only): the slow consumer acks nothing until it is
    set, which run() does once every fast consumer has had every event (the suite's deterministic backlog)."""
    with tempfile.TemporaryDirectory(prefix="events-bench-") as tmp:
        ids = await issue_identities(Path(tmp) / "identities", [], {name: [NAMESPACE] for name in spec.names})
        server = EmbeddedNats(store_dir=Path(tmp) / "nats", config_file=ids.server_config)
        await server.start()
        try:
            admin = await Bus.connect(server.url, name="admin", user=ADMIN, tls=ids.tls(ADMIN))
            try:
                await admin.provision()  # DRA_EVENTS as every deployment makes it
                return await _measure(spec, server, ids, admin, slow_gate)
            finally:
                await admin.close()
        finally:
            await server.close()


def _consumer(spec: RunSpec, name: str, url: str, creds: str, slow_gate: asyncio.Event | None) -> Running:
    slow = name == "slow"
    consumer = ConsumerSpec(
        name=name,
        creds=creds,
        url=url,
        filter_subject=CLAIM.wildcard(namespace=NAMESPACE),  # dra.v1.claim.team-a.*.*
        rate=spec.slow_rate if slow else 0.0,
        batch=100 if slow else 256,
        give_up_s=spec.give_up_s,
        mode=spec.consumer_mode,
    )
    return Running("consumer", consumer, spec.processes, gate=slow_gate if slow else None)


async def _measure(
    spec: RunSpec, server: EmbeddedNats, ids: Any, admin: Bus, slow_gate: asyncio.Event | None
) -> dict[str, Any]:
    stream, names = EVENTS_STREAM.name, spec.names
    if spec.stream_max_bytes:
        info = await admin.js.stream_info(stream)
        info.config.max_bytes = spec.stream_max_bytes
        await admin.js.update_stream(info.config)
    consumers = [_consumer(spec, name, server.url, str(ids.creds[f"reader.{name}"]), slow_gate) for name in names]
    await asyncio.gather(*(c.start() for c in consumers))
    pubs = [
        Running(
            "publisher",
            PublisherSpec(
                url=server.url,
                creds=str(ids.creds[ADMIN]),
                nodes=[f"gpu-node-{p * spec.nodes_per_publisher + i}" for i in range(spec.nodes_per_publisher)],
                rate=spec.rate / spec.publishers,
                seconds=spec.seconds,
            ),
            spec.processes,
        )
        for p in range(spec.publishers)
    ]
    assert server.proc is not None
    await asyncio.gather(*(p.start() for p in pubs))
    server_cpu0, started = cpu_s(server.proc.pid), time.time()
    peaks = dict.fromkeys(names, 0)
    watching = asyncio.create_task(_watch_lag(admin, stream, names, peaks))
    published = [await p.result() for p in pubs]
    ended = max(p["ended_at"] for p in published)
    total = sum(p["stored"] for p in published)
    for consumer in consumers:
        consumer.tell(total)
    server_cpu_publishing = cpu_s(server.proc.pid) - server_cpu0
    lag_at_end = dict(zip(names, await _lags(admin, stream, names), strict=True))
    results = {name: await c.result() for name, c in zip(names, consumers, strict=True) if name != "slow"}
    lag_fast_done = dict(zip(names, await _lags(admin, stream, names), strict=True))
    if slow_gate is not None:
        slow_gate.set()
    if "slow" in names:
        results["slow"] = await consumers[-1].result()
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    info = await admin.js.stream_info(stream)
    out: dict[str, Any] = {
        "rate_asked": spec.rate,
        "seconds": spec.seconds,
        "events": total,
        "publishers": spec.publishers,
        "nodes_per_publisher": spec.nodes_per_publisher,
        "publish_rate_achieved": round(total / max(p["stored_s"] for p in published), 1),
        "publish": published,
        "consumers": {},
        "stream_bytes": info.state.bytes,
        "stream_messages": info.state.messages,
        "stream_max_bytes": info.config.max_bytes,
        "nats_server_cpu_s": {
            "while_publishing": round(server_cpu_publishing, 1),
            "all": round(cpu_s(server.proc.pid) - server_cpu0, 1),
        },
        "publishing_s": round(ended - started, 2),
    }
    for part in published:
        part["cpu_us_per_event"] = round(part["cpu_s"] / max(1, part["stored"]) * 1e6)
    out["nats_server_cpu_us_per_event"] = round(out["nats_server_cpu_s"]["all"] / max(1, total) * 1e6)
    for name, result in results.items():
        result["cpu_us_per_event"] = round(result["cpu_s"] / max(1, result["received"]) * 1e6)
        result["lag_when_publisher_stopped"] = lag_at_end[name]
        result["lag_when_fast_ones_done"] = lag_fast_done[name]
        result["lag_max"] = max(peaks[name], lag_at_end[name])
        result["done_after_publisher_stopped_s"] = round(result["last_at"] - ended, 2)
        out["consumers"][name] = {k: v for k, v in result.items() if k not in ("first_at", "last_at", "name")}
    return out


async def _lags(admin: Bus, stream: str, names: list[str]) -> list[int]:
    """Per durable: the events it has not acked yet (pending in the stream plus delivered, unacked)."""
    infos = [await admin.js.consumer_info(stream, reader_durable(name)) for name in names]
    return [i.num_pending + i.num_ack_pending for i in infos]


async def _watch_lag(admin: Bus, stream: str, names: list[str], peaks: dict[str, int]) -> None:
    """Keep each durable's largest lag in `peaks`, sampled every second (until cancelled)."""
    while True:
        for name, lag in zip(names, await _lags(admin, stream, names), strict=True):
            peaks[name] = max(peaks[name], lag)
        await asyncio.sleep(1.0)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """The run asked for; a pair at `--compare-rate` (one the machine sustains) with and without the slow
    consumer, back to back; a run with DRA_EVENTS shrunk to `--evict-bytes` (what eviction costs)."""
    main_run = RunSpec(seconds=args.seconds, rate=args.rate, slow_rate=args.slow_rate, publishers=args.publishers,
                       nodes_per_publisher=args.nodes_per_publisher, give_up_s=args.give_up_s,
                       consumer_mode=args.consumer_mode)  # fmt: skip
    out: dict[str, Any] = {"load_avg_1m_before": round(os.getloadavg()[0], 2), "consumer_mode": args.consumer_mode}
    out["with_slow"] = await run(main_run)
    out["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    if args.compare_seconds:
        out["pair"] = await _pair(dataclasses.replace(main_run, seconds=args.compare_seconds, rate=args.compare_rate))
        out["load_avg_1m_after_pair"] = round(os.getloadavg()[0], 2)
    if args.evict_bytes:
        small = dataclasses.replace(main_run, seconds=args.compare_seconds or 15.0, stream_max_bytes=args.evict_bytes,
                                    give_up_s=5.0)  # fmt: skip
        out["stream_limit_too_small"] = await run(small)
    out["cores"] = os.cpu_count()
    return out


async def _pair(spec: RunSpec, rounds: int = 2) -> dict[str, Any]:
    """Runs with and without the slow consumer, alternating; the fast consumers' figures of each."""
    runs: dict[str, list[dict[str, Any]]] = {"with_slow": [], "fast_only": []}
    for _ in range(rounds):
        runs["with_slow"].append(await run(spec))
        runs["fast_only"].append(await run(dataclasses.replace(spec, slow_rate=0.0)))

    def fast(variant: str, figure: str, q: str) -> list[float]:
        return [c[figure][q] for r in runs[variant] for n, c in r["consumers"].items() if n != "slow"]

    return {
        "rate_asked": spec.rate,
        "seconds": spec.seconds,
        "rounds": rounds,
        **{
            f"fast_{figure}_{q}": {variant: fast(variant, figure, q) for variant in runs}
            for figure in ("stored_to_delivered_ms", "latency_ms")
            for q in ("p50", "p99")
        },
        "rate_achieved": {v: [r["publish_rate_achieved"] for r in runs[v]] for v in runs},
        "lost_or_doubled": sum(
            c["missing"] + c["duplicates"] for v in runs.values() for r in v for c in r["consumers"].values()
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=10_000.0)
    parser.add_argument("--slow-rate", type=float, default=1_000.0)
    parser.add_argument("--publishers", type=int, default=PUBLISHERS)
    parser.add_argument("--nodes-per-publisher", type=int, default=NODES_PER_PUBLISHER,
                        help="nodes (a sender each, SEND_WINDOW in flight) a publisher process speaks for")  # fmt: skip
    parser.add_argument("--compare-seconds", type=float, default=15.0, help="the pair's length; 0: no pair")
    parser.add_argument("--compare-rate", type=float, default=2_500.0, help="the pair's rate (sustained here)")
    parser.add_argument("--evict-bytes", type=int, default=8 << 20, help="the stream limit of the last run; 0: none")
    parser.add_argument("--consumer-mode", choices=("pull", "push"), default="pull", help="how consumers take delivery")
    parser.add_argument("--give-up-s", type=float, default=60.0, help="a consumer idle this long reports what is lost")
    parser.add_argument("--out", default="bench/results/events.json")
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        freeze_start_up()  # as a `gpu-dra` process starts (shared.cli): no full collection walks its modules
        print(RESULT + json.dumps(asyncio.run(_as_child(args.role, args.spec))), flush=True)
        return
    result = asyncio.run(bench(args))
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
