"""Dashboard benchmark: 1,000 nodes x 8 GPUs in headless Chromium, and the server's memory at that size.

The embedded API server (`gpu-dra apiserver`) and the dashboard (`gpu-dra dashboard --auth none`, with an
embedded nats-server) run as their own processes, as users run them; this process loads N ResourceSlices
of G H100s (NVLink cliques of 18 nodes, every 97th GPU tainted with XID 48) and a claim allocated to every
4th GPU (shifted per node; reserved for a pod, as the scheduler writes it), then drives Debian's chromium over CDP
(tests/dashboard/cdp.py). Figures:
- first render: navigation start to the first frame after every visible row is drawn (the page's own
  `performance.now()`), median of --runs page loads; the full Fleet body size;
- responsiveness: scroll to the bottom, time until the last node's row is drawn (next frame), and the
  frame times of 30 one-screen scroll steps (median and max);
- live: a new claim written to the API server until its GPU tile shows it (at that fleet size);
- server: the dashboard process's RSS (and peak) with the page connected.
With --telemetry (the default) every GPU has 10 minutes of utilisation before the page loads (61 samples per
node on dra.v1.telemetry.<node>, as discovery publishes them), so the first render carries the rings too
(`telemetry_applied_ms`: navigation start until the page has applied them); --no-telemetry for a fleet without.
A screenshot of the fleet view goes to the run's temporary dir (path printed; a small copy to docs/images/
with --docs-images).
Writes bench/results/dashboard.json; goals (issue 20): first render <= 2 s, server <= 150 MB.

    .venv/bin/python bench/dashboard_bench.py [--nodes 1000] [--gpus 8] [--runs 3] [--docs-images]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.procstats import memory_mib  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.events.catalog import TELEMETRY  # noqa: E402
from shared.events.telemetry import DeviceSample, NodeTelemetry  # noqa: E402
from shared.kube.client import kube_api_client  # noqa: E402
from shared.kube.resources import NAMESPACES, NODES, RESOURCECLAIMS, RESOURCESLICES, Kube  # noqa: E402
from shared.natsserver import EmbeddedNats  # noqa: E402
from tests.dashboard.cdp import Browser  # noqa: E402

TENANTS = [f"team-{t}" for t in range(5)]
DRAINS: set[asyncio.Task[None]] = set()  # the children's console, read so they never block on it


def slice_body(n: int, gpus: int) -> dict[str, Any]:
    node = f"node-{n:04d}"
    devices = []
    for g in range(gpus):
        i = n * gpus + g
        dev: dict[str, Any] = {
            "name": f"gpu-{g}",
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": f"GPU-{i:08d}"},
                "productName": {"string": "NVIDIA H100 80GB HBM3"},
                "index": {"int": g},
                "nvlinkClusterUUID": {"string": "bench"},
                "nvlinkCliqueID": {"string": str(n // 18)},
            },
            "capacity": {"memory": {"value": "80Gi"}},
        }
        if i % 97 == 5:
            dev["taints"] = [
                {
                    "key": "gpu.nvidia.com/xid",
                    "value": "48",
                    "effect": "NoSchedule",
                    "timeAdded": "2026-12-04T12:00:00Z",
                }
            ]
        devices.append(dev)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpu.nvidia.com"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def is_claimed(i: int, gpus: int) -> bool:
    """Every 4th GPU, shifted by one per node (so the picture is not in columns); never a tainted one."""
    return (i + i // gpus) % 4 == 0 and i % 97 != 5


async def add_claim(kube: Kube, namespace: str, name: str, node: str, device: str) -> None:
    """A claim allocated to node/device and reserved for pod <name>-pod, as the scheduler writes it."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }
    created = await kube.create(RESOURCECLAIMS, namespace, body)
    status = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": node, "device": device}],
                "config": [],
            }
        },
        "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": f"uid-{name}"}],
    }
    await kube.replace(RESOURCECLAIMS, {**created, "status": status}, subresource="status")


async def bounded(coros: list[Any], width: int = 32) -> None:
    sem = asyncio.Semaphore(width)

    async def one(c: Any) -> None:
        async with sem:
            await c

    await asyncio.gather(*(one(c) for c in coros))


async def start(
    argv: list[str], pattern: str, env: dict[str, str] | None = None, timeout: float = 60
) -> tuple[asyncio.subprocess.Process, re.Match[str]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        *argv,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = (await asyncio.wait_for(proc.stdout.readline(), deadline - time.monotonic())).decode()
        if not line:
            break
        seen.append(line)
        if m := re.search(pattern, line):
            DRAINS.add(asyncio.create_task(drain(proc.stdout)))
            return proc, m
    raise SystemExit(f"gpu-dra {argv[0]} did not print {pattern!r}:\n{''.join(seen[-20:])}")


async def drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


SCROLL_STEPS = """(async () => {
  const v = document.getElementById('viewport');
  const frame = () => new Promise((r) => requestAnimationFrame(() => r(performance.now())));
  const times = [];
  for (let i = 0; i < 30; i++) {
    const t0 = performance.now();
    v.scrollTop += v.clientHeight;
    await frame();
    times.push(performance.now() - t0);
  }
  return times;
})()"""

TO_BOTTOM = """(async () => {
  const v = document.getElementById('viewport');
  const t0 = performance.now();
  v.scrollTop = v.scrollHeight;
  const layout = window.__dash.layout;
  const last = `[data-node="${CSS.escape(layout[layout.length - 1].name)}"]`;
  await new Promise((r) => {
    const f = () => document.querySelector(last) ? requestAnimationFrame(r) : requestAnimationFrame(f);
    f();
  });
  return {ms: performance.now() - t0, rows: document.querySelectorAll('[data-node]').length};
})()"""


def telemetry(n: int, gpus: int, k: int, at: float) -> NodeTelemetry:
    devices = []
    for g in range(gpus):
        busy = is_claimed(n * gpus + g, gpus)
        sm = (70 + (k * 7 + g) % 30) if busy else k % 3
        devices.append(
            DeviceSample(
                device=f"gpu-{g}",
                uuid=f"GPU-{n:04d}-{g:04d}",
                sm_percent=sm,
                memory_used_bytes=(48 if busy else 0) << 30,
                memory_total_bytes=80 << 30,
                power_mw=(560 if busy else 72) * 1000,
                temperature_c=68 if busy else 33,
            )
        )
    return NodeTelemetry(node=f"node-{n:04d}", interval_s=10.0, observed_at=at, devices=devices)


async def publish_telemetry(url: str, http: aiohttp.ClientSession, dash_url: str, nodes: int, gpus: int) -> float:
    """10 minutes of samples for every node (61, 10 s apart, ending now); seconds until the dashboard holds them."""
    bus = await Bus.connect(url, name="bench-telemetry")
    t0 = time.perf_counter()
    try:
        end = time.time()
        for k in range(61):
            for n in range(nodes):
                await bus.publish(TELEMETRY, telemetry(n, gpus, k, end - (60 - k) * 10), node=f"node-{n:04d}")
            await bus.nc.flush()
    finally:
        await bus.close()
    last = f"{dash_url}api/telemetry/node-{nodes - 1:04d}"
    points = 0
    for _ in range(300):
        async with http.get(last) as resp:
            points = len((await resp.json())["devices"]["gpu-0"]["ring"]["t"]) if resp.status == 200 else 0
            if points == 61:
                return time.perf_counter() - t0
        await asyncio.sleep(0.2)
    raise SystemExit(f"the dashboard holds {points} of the 61 samples of {last} after 60 s")


async def main(nodes: int, gpus: int, runs: int, docs_images: bool, with_telemetry: bool = True) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="dashboard-bench-"))
    nats = EmbeddedNats(store_dir=tmp / "nats")
    await nats.start()
    admin = await Bus.connect(nats.url, name="bench-provision")
    await admin.provision()  # the streams and buckets the dashboard reads, as `gpu-dra up` makes them
    await admin.close()
    kubeconfig = tmp / "kubeconfig"
    apiserver, _ = await start(
        ["apiserver", "--port", "0", "--kubeconfig", str(kubeconfig), "--log-level", "warning"], r"listening on"
    )
    dash: asyncio.subprocess.Process | None = None
    browser: Browser | None = None
    api = await kube_api_client(str(kubeconfig))
    try:
        kube = Kube(api)
        t0 = time.perf_counter()
        for ns in TENANTS:
            await kube.create(NAMESPACES, None, {"metadata": {"name": ns}})
        await bounded([kube.create(RESOURCESLICES, None, slice_body(n, gpus)) for n in range(nodes)])
        await bounded(
            [
                kube.create(
                    NODES,
                    None,
                    {
                        "metadata": {"name": f"node-{n:04d}"},
                        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
                    },
                )
                for n in range(nodes)
            ]
        )
        claimed = [i for i in range(nodes * gpus) if is_claimed(i, gpus)]
        await bounded(
            [add_claim(kube, TENANTS[i % 5], f"job-{i}", f"node-{i // gpus:04d}", f"gpu-{i % gpus}") for i in claimed]
        )
        load_s = time.perf_counter() - t0
        print(f"loaded {nodes} slices x {gpus} GPUs and {len(claimed)} claims in {load_s:.1f} s", flush=True)

        dash, m = await start(
            [
                "dashboard",
                "--kubeconfig",
                str(kubeconfig),
                "--listen",
                "127.0.0.1:0",
                "--nats-url",
                nats.url,
                "--log-level",
                "warning",
            ],
            r"dashboard: (http://\S+)",
        )
        url = m.group(1)
        async with aiohttp.ClientSession() as http:
            t0 = time.perf_counter()
            while True:  # the server lists in its own time; nothing to wait on from outside but its answer
                async with http.get(url + "api/fleet") as resp:
                    body = await resp.read()
                fleet = json.loads(body)
                if len(fleet["nodes"]) == nodes and sum(c["claimed"] for c in fleet["counters"].values()) == len(
                    claimed
                ):
                    break
                await asyncio.sleep(0.2)
            listed_s = time.perf_counter() - t0
            print(f"dashboard listed the fleet in {listed_s:.1f} s; /api/fleet is {len(body) / 1e6:.2f} MB", flush=True)
            telemetry_s = await publish_telemetry(nats.url, http, url, nodes, gpus) if with_telemetry else 0.0
        if with_telemetry:
            print(f"published 61 telemetry samples per node; held after {telemetry_s:.1f} s", flush=True)

        browser = await Browser.start(tmp / "chromium")
        renders: list[float] = []
        firsts: list[float] = []  # navigation start to the arrival of the full Fleet event
        applied: list[float] = []  # navigation start until the rings are applied (with --telemetry)
        for _ in range(runs):
            await browser.navigate(url)
            renders.append(await browser.wait_for("window.__dash.firstRenderMs", timeout=30))
            firsts.append(await browser.evaluate("window.__dash.firstEventMs"))
            if with_telemetry:
                applied.append(await browser.wait_for("window.__dash.firstTelemetryMs", timeout=30))
        in_dom = await browser.evaluate("document.querySelectorAll('[data-node]').length")
        shot = await browser.screenshot(tmp / f"fleet-{nodes}-nodes.png")
        print(f"screenshot: {shot}", flush=True)
        if docs_images:
            await browser.screenshot(ROOT / "docs" / "images" / f"fleet-{nodes}-nodes.png", scale=0.5)
        try:
            bottom = await browser.evaluate(TO_BOTTOM, timeout=20)
        except TimeoutError:
            state = await browser.evaluate(
                "({top: document.getElementById('viewport').scrollTop, "
                "height: document.getElementById('viewport').scrollHeight, "
                "rows: [...document.querySelectorAll('[data-node]')].map(e => e.dataset.node), "
                "layout: window.__dash.layout.length, nodes: window.__dash.nodes.size})"
            )
            raise SystemExit(f"the last row was not drawn after scrolling to the bottom: {state}") from None
        await browser.evaluate("document.getElementById('viewport').scrollTop = 0")
        deltas = await browser.evaluate("window.__dash.deltas")
        steps = await browser.evaluate(SCROLL_STEPS, timeout=60)
        deltas = await browser.evaluate("window.__dash.deltas") - deltas

        # a live change at this size: a new claim on a free GPU until its tile shows it
        free = next(i for i in range(nodes * gpus) if not is_claimed(i, gpus) and i % 97 != 5)
        node, device = f"node-{free // gpus:04d}", f"gpu-{free % gpus}"
        t0 = time.perf_counter()
        await add_claim(kube, "team-0", "bench-live", node, device)
        written = time.perf_counter()
        index = await browser.evaluate(f"window.__dash.layout.findIndex((r) => r.key === 'n:{node}')")
        await browser.evaluate(f"document.getElementById('viewport').scrollTop = window.__dash.offsets[{index}]")
        await browser.wait_for(
            f'document.querySelector(\'[data-device="{node}/{device}"][data-claim="team-0/bench-live"]\')', timeout=10
        )
        live_ms = (time.perf_counter() - written) * 1000
        rss, peak = memory_mib(dash.pid)
        return {
            "nodes": nodes,
            "gpus_per_node": gpus,
            "claims": len(claimed) + 1,
            "runs": runs,
            "load_s": round(load_s, 1),
            "server_listed_s": round(listed_s, 1),
            "fleet_body_mb": round(len(body) / 1e6, 2),
            "first_render_ms": {
                "median": round(statistics.median(renders)),
                "max": round(max(renders)),
                "all": [round(r) for r in renders],
            },
            "first_fleet_event_ms": {"median": round(statistics.median(firsts)), "all": [round(f) for f in firsts]},
            "telemetry": with_telemetry,
            "telemetry_applied_ms": {"median": round(statistics.median(applied)), "all": [round(a) for a in applied]}
            if applied
            else None,
            "rows_in_dom": in_dom,
            "scroll_step_frame_ms": {"median": round(statistics.median(steps), 1), "max": round(max(steps), 1)},
            "deltas_during_scroll": deltas,
            "scroll_to_bottom_ms": round(bottom["ms"], 1),
            "rows_in_dom_at_bottom": bottom["rows"],
            "claim_write_to_tile_ms": round(live_ms),
            "claim_write_s": round(written - t0, 3),
            "server_rss_mb": rss,
            "server_peak_rss_mb": peak,
            "goals": {"first_render_ms": 2000, "server_rss_mb": 150},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()[0]},
        }
    finally:
        await api.close()
        if browser is not None:
            await browser.close()
        for proc in (dash, apiserver):
            if proc is not None and proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        await nats.close()
        for scratch in ("chromium", "nats"):  # the screenshot stays
            shutil.rmtree(tmp / scratch, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--docs-images", action="store_true", help="also write a small PNG to docs/images/")
    parser.add_argument("--telemetry", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "dashboard.json")
    args = parser.parse_args()
    result = asyncio.run(main(args.nodes, args.gpus, args.runs, args.docs_images, args.telemetry))
    print(json.dumps(result, indent=2))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
