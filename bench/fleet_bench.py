"""Fleet benchmark: N nodes x 8 GPUs published from cold by R publisher replicas, each its own process.

    .venv/bin/python bench/fleet_bench.py --nodes 10000 --replicas 1 --changes 200
    .venv/bin/python bench/fleet_bench.py --nodes 65000 --replicas 4 --kill

The replicas are the product (`gpu-dra publisher`, services.publisher.cli), run as subprocesses against
an embedded nats-server and a lightweight API server that records writes (bench/recording_apiserver.py;
one port per replica, so every write is attributed to the replica that made it). Every node's
inventory is in KV before the replicas start: "cold" is a publisher with nothing cached and no slices
on the server. Figures: from the replicas' start to the last of 2N slices created, each replica's peak
RSS and CPU, change -> slice latency (publish -> the server has the write), nodes written by more than
one replica, and with --kill: one replica SIGKILLed, changes to its nodes published at once, the time
until a survivor has written them all, with duplicate and lost writes counted.
Writes bench/results/fleet-<nodes>x<replicas>.json (medians over --runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procstats import cpu_s, memory_mib  # noqa: E402
from bench.recording_apiserver import kubeconfig  # noqa: E402
from embedded.harness.discovery import running_discovery  # noqa: E402
from services.publisher.config import PublisherConfig  # noqa: E402
from services.publisher.ownership import owner_of  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.events import catalog  # noqa: E402
from shared.events.inventory import NodeInventory  # noqa: E402
from shared.natsserver import EmbeddedNats  # noqa: E402

FEED_CONCURRENCY = 128
PAGE = 4096


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def node_name(i: int) -> str:
    return f"node-{i:05d}"  # the recording server's Node names


def proc_figures(pid: int) -> tuple[float, float]:
    """(peak RSS MiB, CPU seconds) of a live process, from /proc."""
    return memory_mib(pid)[1], cpu_s(pid)


@contextlib.asynccontextmanager
async def recording_server(nodes: int, ports: int) -> AsyncIterator[dict[str, Any]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "bench" / "recording_apiserver.py"),
        "--nodes",
        str(nodes),
        "--ports",
        str(ports),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(await proc.stdout.readline())
        ready["pid"] = proc.pid
        yield ready
    finally:
        proc.kill()
        await proc.wait()


async def feed(bus: Bus, seed: NodeInventory, nodes: int) -> None:
    """Every node's inventory into KV, as each node's discovery leaves it (before the clock starts)."""
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    gate = asyncio.Semaphore(FEED_CONCURRENCY)

    async def one(i: int) -> None:
        async with gate:
            await kv.put(node_name(i), msgspec.structs.replace(seed, node=node_name(i), observed_at=time.time()))

    for start in range(0, nodes, PAGE):
        await asyncio.gather(*(one(i) for i in range(start, min(nodes, start + PAGE))))


async def start_replica(
    nats_url: str, kubeconfig_path: Path, replica: str, args: argparse.Namespace
) -> asyncio.subprocess.Process:
    code = "import sys; from services.publisher.cli import main; sys.exit(main())"
    if args.profile:  # cProfile of each replica, written when it stops (SIGTERM is a clean stop)
        code = (
            f"import cProfile, sys; from services.publisher.cli import main; "
            f"cProfile.run('main()', {str(args.profile / replica)!r})"
        )
    log = log_file(args.logs, replica) if args.logs else None
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            "--nats-url",
            nats_url,
            "--kubeconfig",
            str(kubeconfig_path),
            "--replica-id",
            replica,
            "--workers",
            str(args.workers),
            "--heartbeat-seconds",
            str(args.heartbeat),
            "--lease-seconds",
            str(args.lease),
            "--probe-seconds",
            str(args.probe),
            "--log-level",
            args.log_level,
            cwd=str(ROOT),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log or (None if args.log_level == "debug" else asyncio.subprocess.DEVNULL),
        )
    finally:
        if log is not None:
            log.close()  # the replica holds its own copy


def log_file(folder: Path, replica: str) -> Any:
    """`folder/<replica>.log`, opened for the replica's stderr (its log lines, with their times)."""
    folder.mkdir(parents=True, exist_ok=True)
    return (folder / f"{replica}.log").open("w")


class Control:
    def __init__(self, session: aiohttp.ClientSession, port: int) -> None:
        self.session = session
        self.base = f"http://127.0.0.1:{port}"

    async def get(self, path: str, **query: Any) -> dict[str, Any]:
        async with self.session.get(
            self.base + path, params={k: str(v) for k, v in query.items()}, timeout=aiohttp.ClientTimeout(total=None)
        ) as resp:
            doc: dict[str, Any] = await resp.json()
            return doc


async def change(bus: Bus, seed: NodeInventory, node: str, rev: int) -> None:
    gpus = list(seed.gpus)
    gpus[0] = msgspec.structs.replace(gpus[0], product_name=f"NVIDIA H100 80GB HBM3 rev{rev}")
    inv = msgspec.structs.replace(seed, node=node, gpus=gpus, observed_at=time.time())
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    await kv.put(node, inv)
    await bus.publish(catalog.INVENTORY, inv, node=node)


async def latencies(bus: Bus, ctl: Control, seed: NodeInventory, nodes: int, changes: int) -> list[float]:
    """Change -> slice: one change at a time, publish to the server's record of the write, in ms."""
    out: list[float] = []
    for i in range(changes):
        node = node_name((i * 7919) % nodes)
        before = (await ctl.get("/count", node=node))["count"]
        t0 = time.monotonic()
        await change(bus, seed, node, 1000 + i)
        done = await ctl.get("/wait", node=node, after=before)
        out.append((done["at"] - t0) * 1000)
    return out


async def kill_one(
    bus: Bus,
    ctl: Control,
    seed: NodeInventory,
    procs: dict[str, asyncio.subprocess.Process],
    nodes: int,
    sample: int,
    timeout_s: float,
) -> dict[str, Any]:
    """SIGKILL one replica; change `sample` of its nodes at once; how long until survivors wrote them."""
    victim = sorted(procs)[-1]
    everyone = frozenset(procs)
    theirs = [node_name(i) for i in range(nodes) if owner_of(node_name(i), everyone) == victim]
    changed = theirs[:: max(1, len(theirs) // sample)][:sample]
    counts = {n: (await ctl.get("/count", node=n))["count"] for n in changed}
    before = await ctl.get("/summary")
    procs[victim].send_signal(signal.SIGKILL)
    await procs[victim].wait()
    killed, killed_at = time.monotonic(), time.time()
    await asyncio.gather(*(change(bus, seed, n, 5000) for n in changed))
    stored = time.monotonic()  # every change in JetStream: what came after it is the survivors' part

    async def written(node: str) -> float | None:
        try:
            async with asyncio.timeout(timeout_s):
                return float((await ctl.get("/wait", node=node, after=counts[node]))["at"])
        except TimeoutError:
            return None

    arrivals = await asyncio.gather(*(written(n) for n in changed))
    after = await ctl.get("/summary")
    extra = {n: (await ctl.get("/count", node=n))["count"] - counts[n] for n in changed}
    landed = [a for a in arrivals if a is not None]
    return {
        "killed_replica_nodes": len(theirs),
        "killed_at_unix": round(killed_at, 3),  # to read the survivors' --logs against
        "changed_nodes": len(changed),
        "takeover_all_written_s": round(max(landed) - killed, 2) if landed else None,
        "takeover_first_written_s": round(min(landed) - killed, 2) if landed else None,
        "takeover_changes_stored_s": round(stored - killed, 2),
        "lost_writes": sum(1 for a in arrivals if a is None),
        "duplicate_writes": sum(max(0, c - 1) for c in extra.values()),
        "nodes_written_by_several_before_kill": before["nodes_written_by_several"],
        "writes_after_kill": sum(after["writes"].values()) - sum(before["writes"].values()),
        "same_hash_rewrites": after["same_hash_rewrites"],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    # removed after: the JetStream store of up to 65,000 inventories, the sim tree, the kubeconfigs
    with tempfile.TemporaryDirectory(prefix="fleet-bench-", ignore_cleanup_errors=True) as tmp:
        return await _run(args, Path(tmp))


async def _run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    replica_ids = [f"pub-{i}" for i in range(args.replicas)]
    async with (
        EmbeddedNats(store_dir=tmp / "nats") as nats_srv,
        recording_server(args.nodes, args.replicas) as server,
        aiohttp.ClientSession() as session,
    ):
        bus = await Bus.connect(nats_srv.url, name="fleet-bench")
        await bus.provision()
        async with running_discovery(bus, node="seed", simulate="h100x8", root=tmp / "sim") as disc:
            seed = disc.inventory
        t_feed = time.monotonic()
        await feed(bus, seed, args.nodes)
        feed_s = time.monotonic() - t_feed
        ctl = Control(session, server["control"])
        procs: dict[str, asyncio.subprocess.Process] = {}
        for replica, port in zip(replica_ids, server["ports"], strict=True):
            path = tmp / f"kubeconfig-{replica}"
            path.write_text(json.dumps(kubeconfig(port)))
            procs[replica] = await start_replica(nats_srv.url, path, replica, args)
        started = time.monotonic()
        try:
            async with asyncio.timeout(args.timeout):
                done = await ctl.get("/wait", creates=2 * args.nodes)
            publish_s = done["at"] - started
            figures = {pid: proc_figures(p.pid) for pid, p in procs.items()}
            cold = await ctl.get("/summary")
            result: dict[str, Any] = {
                "nodes": args.nodes,
                "gpus_per_node": 8,
                "replicas": args.replicas,
                "workers": args.workers,
                "publish_all_s": round(publish_s, 2),
                "first_write_s": round(cold["first_write"] - started, 2),
                "replica_peak_rss_mib_max": round(max(r for r, _ in figures.values())),
                "replica_cpu_s_max": round(max(c for _, c in figures.values()), 2),
                "replica_cpu_ms_per_node": round(1000 * sum(c for _, c in figures.values()) / args.nodes, 2),
                "apiserver_cpu_s": round(proc_figures(server["pid"])[1], 2),
                "nodes_written_by_several": cold["nodes_written_by_several"],
                "conflicts": cold["conflicts"],
                "writes": sum(cold["writes"].values()),
                "inventories_fed_s": round(feed_s, 2),
            }
            if args.changes:
                lat = await latencies(bus, ctl, seed, args.nodes, args.changes)
                result |= {
                    "change_to_slice_ms_p50": round(statistics.median(lat), 2),
                    "change_to_slice_ms_p99": round(pct(lat, 0.99), 2),
                    "changes": len(lat),
                }
            if args.kill:
                result |= await kill_one(bus, ctl, seed, procs, args.nodes, args.kill_sample, args.kill_timeout)
            result["load_avg_1m"] = round(os.getloadavg()[0], 2)
        finally:
            for proc in procs.values():
                if proc.returncode is None:
                    proc.terminate()
            for proc in procs.values():
                await proc.wait()
            await bus.close()
    return result


SPREAD = (
    "publish_all_s",
    "change_to_slice_ms_p99",
    "takeover_first_written_s",
    "takeover_all_written_s",
    "takeover_changes_stored_s",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10000)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--workers", type=int, default=64, help="each replica's --workers")
    parser.add_argument("--changes", type=int, default=200, help="change -> slice samples (one at a time)")
    parser.add_argument("--kill", action="store_true", help="SIGKILL one replica after the cold publish")
    parser.add_argument("--kill-sample", type=int, default=200, help="its nodes changed right after the kill")
    parser.add_argument("--kill-timeout", type=float, default=30.0)
    defaults = PublisherConfig()
    parser.add_argument(
        "--heartbeat", type=float, default=defaults.heartbeat_seconds, help="each replica's --heartbeat-seconds"
    )
    parser.add_argument("--lease", type=float, default=defaults.lease_seconds, help="each replica's --lease-seconds")
    parser.add_argument(
        "--probe", type=float, default=defaults.probe_seconds, help="each replica's --probe-seconds (0: lease only)"
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--logs", type=Path, default=None, help="a folder: keep each replica's log in it")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--runs", type=int, default=1, help="each figure is the median over this many runs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", type=Path, default=None, help="a folder: cProfile each replica into it")
    args = parser.parse_args()
    runs = []
    logs = args.logs
    for index in range(args.runs):
        if logs is not None and args.runs > 1:
            args.logs = logs / f"run-{index + 1}"  # each run's replica logs of their own
        runs.append(asyncio.run(run(args)))
    figures: dict[str, Any] = {"runs": args.runs, "cores": os.cpu_count()}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        figures[key] = statistics.median(values) if numeric else first
        if numeric and args.runs > 1 and key in SPREAD:
            figures[f"{key}_runs"] = values  # each run's, where one outlier would hide behind the median
    for key, value in figures.items():
        print(f"{key:>38}: {value}")
    out = args.out or ROOT / "bench" / "results" / f"fleet-{args.nodes}x{args.replicas}.json"
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
