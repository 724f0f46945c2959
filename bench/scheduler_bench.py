"""Allocation time for one claim in a 1,000-node x 8-GPU simulated pool; writes bench/results/scheduler.json.

Figures: building the slice index, first-fit allocation (cold: a fresh index, CEL result caches
emptied, median of 5; warm: the same index again, median of 45), a filter pass over every node (as
kube-scheduler's Filter), and warm CEL cost per evaluation. Wall and process-CPU milliseconds: on a
shared machine the CPU figure is the steadier one.
Through the loop: 100 single-GPU pods (one template each) against the in-process API server, 4
simulated 16-GPU H100 nodes (16 is the most a node may simulate, so 100 pods do not fit at once: two
waves of 50, each created in a burst, bound, then deleted and its claims freed), the Scheduler as a
task; "pod created -> bound" latency per pod (create call start -> a pods watch sees
spec.nodeName), p50/p99 over the 100 pods, median of 3 runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from embedded.apiserver.testing import running_apiserver
from embedded.scheduler import cel as cel_module
from embedded.scheduler.allocator import AllocatedState, schedule
from embedded.scheduler.cel import DeviceEnv, compile_selector
from embedded.scheduler.loop import Scheduler
from embedded.scheduler.pools import SliceIndex
from embedded.scheduler.simslices import node_slices, renamed, simulated_inventory
from shared.deviceclasses import device_classes
from shared.kube.resources import DEVICECLASSES, PODS, RESOURCECLAIMTEMPLATES, RESOURCESLICES, Kube
from shared.kube.resources import NODES as NODE_RESOURCE

NODES = 1000
LOOP_PODS = 100
LOOP_NODES = 4
LOOP_WAVE = 50
LOOP_GPUS = "h100x16"
COLD_RUNS = 5
WARM_RUNS = 45


def _claim(i: int) -> dict[str, Any]:
    sel = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"
    return {
        "metadata": {"namespace": "bench", "name": f"c{i}"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {"deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": sel}}]},
                    }
                ]
            }
        },
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def loop_latency(inv: Any) -> dict[str, float]:
    """One run of 100 pods through the scheduler loop; latencies in ms."""
    base = node_slices(inv)
    with tempfile.TemporaryDirectory(prefix="gpu-dra-sched-bench-") as tmp:
        async with running_apiserver(Path(tmp)) as api, api.client() as client:
            kube = Kube(client)
            for cls in device_classes("v1"):
                await kube.create(DEVICECLASSES, None, cls)
            for i in range(LOOP_NODES):
                name = f"node-{i}"
                await kube.create(
                    NODE_RESOURCE,
                    None,
                    {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
                )
                for s in renamed(base, inv.node, name):
                    s["metadata"].pop("ownerReferences", None)
                    await kube.create(RESOURCESLICES, None, s)
            await kube.create(
                RESOURCECLAIMTEMPLATES,
                "default",
                {
                    "metadata": {"name": "one-gpu", "namespace": "default"},
                    "spec": {
                        "spec": {
                            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}
                        }
                    },
                },
            )
            stopping = asyncio.Event()
            scheduler = Scheduler(client)
            task = asyncio.create_task(scheduler.run(stopping))
            await scheduler.ready.wait()
            _, rv = await kube.list(PODS, "default")
            created: dict[str, float] = {}
            bound: dict[str, float] = {}
            wave_bound = asyncio.Event()

            async def watch() -> None:
                async for kind, pod in kube.watch(PODS, rv, timeout_s=120):
                    if kind == "BOOKMARK":
                        continue
                    name = pod["metadata"]["name"]
                    if pod["spec"].get("nodeName") and name not in bound:
                        bound[name] = time.perf_counter()
                        if len(bound) % LOOP_WAVE == 0:
                            wave_bound.set()

            watcher = asyncio.create_task(watch())
            start = time.perf_counter()
            for wave in range(LOOP_PODS // LOOP_WAVE):
                wave_bound.clear()
                names = [f"p{wave * LOOP_WAVE + i:03d}" for i in range(LOOP_WAVE)]
                for name in names:
                    created[name] = time.perf_counter()
                    await kube.create(
                        PODS,
                        "default",
                        {
                            "metadata": {"name": name},
                            "spec": {
                                "terminationGracePeriodSeconds": 0,
                                "containers": [
                                    {"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}
                                ],
                                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
                            },
                        },
                    )
                await asyncio.wait_for(wave_bound.wait(), 120)
                for name in names:
                    await kube.delete(PODS, "default", name)
                while scheduler.state.allocated.devices:  # the generated claims are garbage-collected
                    await asyncio.sleep(0.01)
            total = time.perf_counter() - start
            stopping.set()
            await task
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            latencies = [(bound[n] - created[n]) * 1e3 for n in created]
            return {"p50": _percentile(latencies, 0.5), "p99": _percentile(latencies, 0.99), "total": total}


def main() -> int:
    inv = asyncio.run(simulated_inventory("node-0000", "h100x8"))
    base = node_slices(inv)
    big = asyncio.run(simulated_inventory("big-node", LOOP_GPUS))
    loop_runs = [asyncio.run(loop_latency(big)) for _ in range(3)]
    nodes = [f"node-{i:04d}" for i in range(NODES)]
    slices = [s for n in nodes for s in renamed(base, "node-0000", n)]
    classes = device_classes()
    t = time.perf_counter()
    index = SliceIndex(slices)
    build_ms = (time.perf_counter() - t) * 1e3
    # Every node but the last is full: the first-fit search walks all nodes (worst case).
    state = AllocatedState({("gpu.nvidia.com", n, f"gpu-{g}"): "bench/busy" for n in nodes[:-1] for g in range(8)})
    cold, cold_cpu = [], []
    for i in range(COLD_RUNS):  # each on a fresh index with the CEL result caches emptied
        index = SliceIndex(slices)
        cel_module._projected.clear()
        t, c = time.perf_counter(), time.process_time()
        out = schedule([_claim(i)], classes, index, state, nodes)
        cold.append((time.perf_counter() - t) * 1e3)
        cold_cpu.append((time.process_time() - c) * 1e3)
        assert out.node == nodes[-1]
    warm, warm_cpu = [], []
    for i in range(WARM_RUNS):
        t, c = time.perf_counter(), time.process_time()
        schedule([_claim(100 + i)], classes, index, state, nodes)
        warm.append((time.perf_counter() - t) * 1e3)
        warm_cpu.append((time.process_time() - c) * 1e3)
    t = time.perf_counter()
    first = schedule([_claim(9)], classes, index, AllocatedState(), nodes)
    first_fit_ms = (time.perf_counter() - t) * 1e3
    assert first.node == nodes[0]
    env = DeviceEnv("gpu.nvidia.com", base[0]["spec"]["devices"][0])
    sel = compile_selector("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0")
    t = time.perf_counter()
    for _ in range(5000):
        env._evaluate(sel)
    cel_us = (time.perf_counter() - t) / 5000 * 1e6
    figures = {
        "nodes": NODES,
        "gpus_per_node": 8,
        "slices": len(slices),
        "index_build_ms": round(build_ms, 1),
        "one_claim_all_nodes_filtered_cold_ms_median": round(statistics.median(cold), 1),
        "one_claim_all_nodes_filtered_cold_cpu_ms_median": round(statistics.median(cold_cpu), 1),
        "one_claim_all_nodes_filtered_warm_ms_median": round(statistics.median(warm), 1),
        "one_claim_all_nodes_filtered_warm_cpu_ms_median": round(statistics.median(warm_cpu), 1),
        "one_claim_first_node_fits_ms": round(first_fit_ms, 2),
        "cel_evaluation_warm_us": round(cel_us, 2),
        "loop_pods": LOOP_PODS,
        "loop_nodes": LOOP_NODES,
        "loop_gpus_per_node": 16,
        "loop_wave": LOOP_WAVE,
        "loop_pod_created_to_bound_p50_ms_median": round(statistics.median(r["p50"] for r in loop_runs), 1),
        "loop_pod_created_to_bound_p99_ms_median": round(statistics.median(r["p99"] for r in loop_runs), 1),
        "loop_all_pods_bound_s_median": round(statistics.median(r["total"] for r in loop_runs), 2),
    }
    for k, v in figures.items():
        print(f"{k:45} {v}")
    out_path = Path(__file__).parent / "results" / "scheduler.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
