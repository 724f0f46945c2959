"""Flood bench: one node stores claim events at 100x its share for 60 s while other nodes carry on.

A real nats-server (JetStream) with the catalog's streams, one state gate (services/stategate) with the
default share (64 KiB/s after an 8 MiB burst), `--honest` nodes publishing a claim event every 50 ms each
through their gated buses, and one node publishing 16 KiB events at 100x its share. Figures: what the
flooder stored and had refused, how many of the other nodes' events are still in DRA_EVENTS at the end
(all of them is the bar), and the other nodes' publish latency (p50/p99) before and during the flood.

Run: `.venv/bin/python bench/flood_bench.py [--seconds 60] [--honest 4] [--out bench/results/flood.json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats.js.errors  # noqa: E402

from services.stategate.gate import StateGate  # noqa: E402
from services.stategate.quota import Share  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.events import catalog  # noqa: E402
from shared.events.claims import ClaimLifecycle  # noqa: E402
from shared.natsserver import EmbeddedNats  # noqa: E402

SHARE, BURST, EVENT = 64 * 1024, 8 * 1024 * 1024, 16 * 1024


def _event(node: str, n: int, pad: int = 0) -> ClaimLifecycle:
    return ClaimLifecycle(
        event_id=f"{node}/{n}",
        claim_uid=f"uid-{node}-{n}",
        claim_namespace=f"ns-{node}",
        claim_name="c" + "x" * pad,
        node=node,
        driver="gpu.nvidia.com",
        event="prepared",
        observed_at=time.time(),
    )


async def _publish(bus: Bus, event: ClaimLifecycle) -> None:
    await bus.publish(
        catalog.CLAIM, event, msg_id=event.event_id, namespace=event.claim_namespace, node=event.node, event="prepared"
    )


async def _honest(
    bus: Bus,
    node: str,
    stop: asyncio.Event,
    flooding: asyncio.Event,
    latencies: dict[str, list[float]],
    sent: list[str],
) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        event = _event(node, n)
        start = time.perf_counter()
        await _publish(bus, event)
        latencies["during" if flooding.is_set() else "before"].append((time.perf_counter() - start) * 1000)
        sent.append(event.event_id)
        await asyncio.sleep(0.05)


async def _flood(bus: Bus, seconds: float) -> tuple[int, int]:
    loop = asyncio.get_running_loop()
    start, stored, refused, n = loop.time(), 0, 0, 0
    while loop.time() - start < seconds:
        n += 1
        try:
            await _publish(bus, _event("flooder", n, pad=EVENT))
            stored += 1
        except nats.js.errors.APIError:
            refused += 1
        await asyncio.sleep(max(0.0, start + n * EVENT / (100 * SHARE) - loop.time()))
    return stored, refused


async def _stored_ids(admin: Bus, nodes: list[str]) -> set[str]:
    ids: set[str] = set()
    for node in nodes:
        subject = catalog.CLAIM.wildcard(node=node)
        info = await admin.js.stream_info(catalog.EVENTS_STREAM.name, subjects_filter=subject)
        count = sum((info.state.subjects or {}).values())
        sub = await admin.js.subscribe(subject, stream=catalog.EVENTS_STREAM.name, ordered_consumer=True)
        for _ in range(count):
            ids.add(json.loads((await sub.next_msg(timeout=10)).data)["event_id"])
        await sub.unsubscribe()
    return ids


async def run(seconds: float, honest: int) -> dict[str, object]:
    server = EmbeddedNats()
    await server.start()
    try:
        admin = await Bus.connect(server.url, name="admin")
        await admin.provision()
        gate_bus = await Bus.connect(server.url, name="state-gate")
        await StateGate(gate_bus, Share(rate=SHARE, burst=BURST)).start()
        nodes = [f"node-{i}" for i in range(honest)]
        buses = [await Bus.connect(server.url, name=f"preparer.{n}", user=f"preparer.{n}") for n in nodes]
        flooder = await Bus.connect(server.url, name="preparer.flooder", user="preparer.flooder")
        stop, flooding = asyncio.Event(), asyncio.Event()
        latencies: dict[str, list[float]] = {"before": [], "during": []}
        sent: list[str] = []
        tasks = [
            asyncio.create_task(_honest(bus, node, stop, flooding, latencies, sent))
            for bus, node in zip(buses, nodes, strict=True)
        ]
        await asyncio.sleep(2.0)
        flooding.set()
        flood_start = time.perf_counter()
        stored, refused = await _flood(flooder, seconds)
        flood_s = time.perf_counter() - flood_start
        stop.set()
        await asyncio.gather(*tasks)
        kept = await _stored_ids(admin, nodes)
        info = await admin.js.stream_info(catalog.EVENTS_STREAM.name)
        for bus in [*buses, flooder, gate_bus, admin]:
            await bus.close()
    finally:
        await server.close()

    def pct(values: list[float], q: float) -> float:
        return round(statistics.quantiles(values, n=100)[int(q) - 1], 2) if len(values) >= 2 else 0.0

    return {
        "flood_seconds": round(flood_s, 1),
        "share_bytes_per_s": SHARE,
        "burst_bytes": BURST,
        "flood_rate_bytes_per_s": 100 * SHARE,
        "flood_event_bytes": EVENT,
        "flooder_stored": stored,
        "flooder_refused": refused,
        "flooder_stored_bytes_per_s": round(stored * EVENT / flood_s),
        "other_nodes": honest,
        "other_events_sent": len(sent),
        "other_events_kept": len(kept & set(sent)),
        "other_events_evicted": len(set(sent) - kept),
        "other_publish_ms_before": {"p50": pct(latencies["before"], 50), "p99": pct(latencies["before"], 99)},
        "other_publish_ms_during": {"p50": pct(latencies["during"], 50), "p99": pct(latencies["during"], 99)},
        "stream_bytes_at_end": info.state.bytes,
        "stream_max_bytes": catalog.EVENTS_STREAM.max_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--honest", type=int, default=4)
    parser.add_argument("--out", default="bench/results/flood.json")
    args = parser.parse_args()
    result = asyncio.run(run(args.seconds, args.honest))
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
