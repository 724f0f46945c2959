"""Embedded API server benchmark: list latency for 10,000 ResourceSlices and watch fan-out.

The server runs as `gpu-dra apiserver` in its own process (as users run it); this process is the
client, over real HTTPS. Figures: create throughput while loading, list latency (median and p90 of
N full LISTs, body read and JSON-decoded), and watch fan-out: W watchers each receiving every one
of E changes, reported as delivered events per second. Writes bench/results/apiserver.json.

    .venv/bin/python bench/apiserver_bench.py [--slices 10000] [--runs 15] [--watchers 100] [--events 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec
import yaml

ROOT = Path(__file__).resolve().parents[1]
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def slice_body(i: int) -> dict:
    node = f"node-{i:05d}"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpu.nvidia.com", "labels": {"bench": "true"}},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": f"gpu-{d}",
                    "attributes": {"productName": {"string": "NVIDIA H100 80GB HBM3"}, "index": {"int": d}},
                    "capacity": {"memory": {"value": "80Gi"}},
                }
                for d in range(8)
            ],
        },
    }


async def start_server(tmp: Path) -> tuple[asyncio.subprocess.Process, str, str]:
    kubeconfig = tmp / "kubeconfig"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        "apiserver",
        "--port",
        "0",
        "--kubeconfig",
        str(kubeconfig),
        "--log-level",
        "warning",
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    if "listening on" not in line:
        raise SystemExit(f"apiserver did not start: {line!r}")
    config = yaml.safe_load(kubeconfig.read_text())
    return proc, config["clusters"][0]["cluster"]["server"], config["users"][0]["user"]["token"]


async def load(http: aiohttp.ClientSession, url: str, count: int, concurrency: int = 32) -> float:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            async with http.post(url + SLICES, json=slice_body(i)) as resp:
                if resp.status != 201:
                    raise SystemExit(f"create failed: {resp.status} {await resp.text()}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return count / (time.perf_counter() - t0)


async def list_latency(http: aiohttp.ClientSession, url: str, runs: int, expected: int) -> dict:
    """Request to last byte of the body (the server's figure), and the client's msgspec decode apart."""
    times, decodes, size = [], [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        async with http.get(url + SLICES) as resp:
            body = await resp.read()
        t1 = time.perf_counter()
        items = msgspec.json.decode(body)["items"]
        decodes.append(time.perf_counter() - t1)
        times.append(t1 - t0)
        size = len(body)
        assert len(items) == expected, len(items)
    times.sort()
    return {
        "median_ms": round(statistics.median(times) * 1000, 1),
        "p90_ms": round(times[max(0, int(len(times) * 0.9) - 1)] * 1000, 1),
        "min_ms": round(times[0] * 1000, 1),
        "runs": runs,
        "bytes": size,
        "client_msgspec_decode_median_ms": round(statistics.median(decodes) * 1000, 1),
    }


async def fan_out(http: aiohttp.ClientSession, url: str, watchers: int, events: int) -> dict:
    async with http.get(url + "/api/v1/namespaces/default/configmaps?limit=1") as resp:
        rv = (await resp.json())["metadata"]["resourceVersion"]
    ready = 0
    all_ready = asyncio.Event()
    received = [0] * watchers
    done_at: list[float] = []

    async def watcher(n: int) -> None:
        nonlocal ready
        params = {"watch": "true", "resourceVersion": rv, "timeoutSeconds": "120"}
        async with http.get(url + "/api/v1/namespaces/default/configmaps", params=params) as resp:
            ready += 1
            if ready == watchers:
                all_ready.set()
            while received[n] < events:
                line = await resp.content.readline()
                if not line:
                    raise SystemExit("a watch ended early")
                received[n] += 1
            done_at.append(time.perf_counter())

    tasks = [asyncio.create_task(watcher(n)) for n in range(watchers)]
    await asyncio.wait_for(all_ready.wait(), 60)
    t0 = time.perf_counter()
    for i in range(events):
        async with http.post(
            url + "/api/v1/namespaces/default/configmaps",
            json={"metadata": {"name": f"fan-{i}"}, "data": {"i": str(i)}},
        ) as resp:
            assert resp.status == 201
    writes_done = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*tasks), 300)
    elapsed = max(done_at) - t0
    return {
        "watchers": watchers,
        "events_per_watcher": events,
        "delivered": watchers * events,
        "seconds": round(elapsed, 3),
        "delivered_events_per_s": round(watchers * events / elapsed),
        "write_seconds": round(writes_done - t0, 3),
    }


async def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slices", type=int, default=10000)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--watchers", type=int, default=100)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "apiserver.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url, token = await start_server(Path(tmp))
        try:
            connector = aiohttp.TCPConnector(ssl=False, limit=args.watchers + 64)
            timeout = aiohttp.ClientTimeout(total=None)
            headers = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as http:
                creates = await load(http, url, args.slices)
                listing = await list_latency(http, url, args.runs, args.slices)
                watch = await fan_out(http, url, args.watchers, args.events)
        finally:
            proc.terminate()
            await proc.wait()
    result = {
        "benchmark": "apiserver",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "slices": args.slices,
        "create_per_s": round(creates),
        "list": listing,
        "watch_fan_out": watch,
    }
    out = Path(args.out)
    await asyncio.to_thread(out.parent.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(out.write_text, json.dumps(result, indent=2) + "\n")
    print(f"created {args.slices} ResourceSlices at {creates:.0f}/s")
    print(
        f"LIST {args.slices} slices ({listing['bytes'] / 1e6:.1f} MB): median {listing['median_ms']} ms, "
        f"p90 {listing['p90_ms']} ms over {args.runs} runs "
        f"(client decode {listing['client_msgspec_decode_median_ms']} ms)"
    )
    print(
        f"watch fan-out: {watch['watchers']} watchers x {watch['events_per_watcher']} events = "
        f"{watch['delivered']} deliveries in {watch['seconds']} s -> {watch['delivered_events_per_s']} events/s"
    )
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    asyncio.run(main())
