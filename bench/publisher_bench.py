"""Publisher benchmark: N simulated nodes x 8 GPUs published, a no-op resync, and change->slice latency.

Runs everything in-process: embedded nats-server, embedded API server, one publisher replica.
Prints the figures and writes bench/results/publisher.json.
    .venv/bin/python bench/publisher_bench.py [--nodes 1000] [--changes 100] [--runs 3]
Each figure is the median over the runs (a fresh NATS, API server and publisher each time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from embedded.apiserver.testing import running_apiserver  # noqa: E402
from embedded.harness.discovery import running_discovery  # noqa: E402
from embedded.harness.publisher import ensure_node, running_publisher, until  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.events import catalog  # noqa: E402
from shared.kube.client import kube_api_client
from shared.natsserver import EmbeddedNats  # noqa: E402

FEED_CONCURRENCY = 64


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def main(nodes: int, changes: int) -> dict[str, object]:
    # removed after: the JetStream store, the API server's data, the sim tree
    with tempfile.TemporaryDirectory(prefix="publisher-bench-", ignore_cleanup_errors=True) as tmp:
        return await _main(Path(tmp), nodes, changes)


async def _main(tmp: Path, nodes: int, changes: int) -> dict[str, object]:
    async with EmbeddedNats(store_dir=tmp / "nats") as nats_srv, running_apiserver(tmp / "api") as api:
        bus = await Bus.connect(nats_srv.url, name="bench")
        await bus.provision()
        client = await kube_api_client(str(api.kubeconfig_path))
        async with running_discovery(bus, node="seed", simulate="h100x8", root=tmp / "sim") as disc:
            seed = disc.inventory
        names = [f"node-{i:04d}" for i in range(nodes)]
        await asyncio.gather(*(ensure_node(client, n) for n in names))
        kv = await bus.kv(catalog.INVENTORY_BUCKET)
        async with running_publisher(nats_srv.url, str(api.kubeconfig_path), workers=32) as pub:
            # Every node's discovery publishes on its own: the inventories arrive concurrently (at most
            # FEED_CONCURRENCY in flight from this one process), not one after the other.
            feed = asyncio.Semaphore(FEED_CONCURRENCY)

            async def announce(n: str) -> None:
                async with feed:
                    inv = msgspec.structs.replace(seed, node=n, observed_at=time.time())
                    await kv.put(n, inv)
                    await bus.publish(catalog.INVENTORY, inv, node=n)

            start, cpu0 = time.perf_counter(), time.process_time()
            await asyncio.gather(*(announce(n) for n in names))
            feed_s = time.perf_counter() - start

            async def all_written() -> bool:
                return pub.stats.creates >= 2 * nodes

            await until(pub, all_written, timeout=600)
            publish_s = time.perf_counter() - start
            publish_cpu_s = time.process_time() - cpu0  # API server + publisher + this driver: one process
            await pub.idle()
            before = pub.stats.writes
            t0 = time.perf_counter()
            await pub.resync()
            await pub.idle()
            resync_s = time.perf_counter() - t0
            noop_writes = pub.stats.writes - before
            pub.latencies.clear()
            for i in range(changes):
                n = names[i % nodes]
                gpus = list(seed.gpus)
                gpus[0] = msgspec.structs.replace(gpus[0], product_name=f"NVIDIA H100 80GB HBM3 rev{i}")
                inv = msgspec.structs.replace(seed, node=n, gpus=gpus, observed_at=time.time())
                want = len(pub.latencies) + 1
                await kv.put(n, inv)
                await bus.publish(catalog.INVENTORY, inv, node=n)

                async def seen(want: int = want) -> bool:
                    return len(pub.latencies) >= want

                await until(pub, seen, timeout=30)
            lat = [x * 1000 for x in pub.latencies]
        await client.close()
        await bus.close()
    return {
        "nodes": nodes,
        "gpus_per_node": 8,
        "slices_written": 2 * nodes,
        "publish_all_s": round(publish_s, 2),
        "inventories_fed_s": round(feed_s, 2),
        "publish_all_cpu_s": round(publish_cpu_s, 2),
        "nodes_per_s": round(nodes / publish_s, 1),
        "noop_resync_writes": noop_writes,
        "noop_resync_s": round(resync_s, 2),
        "change_to_slice_ms_p50": round(statistics.median(lat), 2) if lat else None,
        "change_to_slice_ms_p99": round(pct(lat, 0.99), 2) if lat else None,
        "changes": len(lat),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3, help="each figure is the median over this many runs")
    args = parser.parse_args()
    runs = [asyncio.run(main(args.nodes, args.changes)) for _ in range(args.runs)]
    figures: dict[str, object] = {"runs": args.runs}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        numeric = isinstance(first, (int, float)) and all(isinstance(v, (int, float)) for v in values)
        figures[key] = statistics.median(values) if numeric else first  # type: ignore[type-var]
    for key, value in figures.items():
        print(f"{key:>26}: {value}")
    out = Path(__file__).resolve().parent / "results" / "publisher.json"
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"written {out}")
