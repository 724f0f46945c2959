"""Allocation time for one claim in a 1,000-node x 8-GPU simulated pool; writes bench/results/scheduler.json.

Figures: building the slice index, first-fit allocation (cold: device CEL environments built; warm:
reused), a filter pass over every node (as kube-scheduler's Filter), and warm CEL cost per evaluation.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

from embedded.scheduler.allocator import AllocatedState, schedule
from embedded.scheduler.cel import DeviceEnv, compile_selector
from embedded.scheduler.pools import SliceIndex
from embedded.scheduler.simslices import node_slices, renamed, simulated_inventory
from shared.deviceclasses import device_classes

NODES = 1000


def _claim(i: int) -> dict:
    sel = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"
    return {"metadata": {"namespace": "bench", "name": f"c{i}"}, "spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": sel}}]}}]}}}


def main() -> int:
    inv = asyncio.run(simulated_inventory("node-0000", "h100x8"))
    base = node_slices(inv)
    nodes = [f"node-{i:04d}" for i in range(NODES)]
    slices = [s for n in nodes for s in renamed(base, "node-0000", n)]
    classes = device_classes()
    t = time.perf_counter()
    index = SliceIndex(slices)
    build_ms = (time.perf_counter() - t) * 1e3
    # Every node but the last is full: the first-fit search walks all nodes (worst case).
    state = AllocatedState({("gpu.nvidia.com", n, f"gpu-{g}"): "bench/busy" for n in nodes[:-1] for g in range(8)})
    t = time.perf_counter()
    out = schedule([_claim(0)], classes, index, state, nodes)
    cold_ms = (time.perf_counter() - t) * 1e3
    assert out.node == nodes[-1]
    warm = []
    for i in range(5):
        t = time.perf_counter()
        schedule([_claim(i)], classes, index, state, nodes)
        warm.append((time.perf_counter() - t) * 1e3)
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
        "nodes": NODES, "gpus_per_node": 8, "slices": len(slices),
        "index_build_ms": round(build_ms, 1),
        "one_claim_all_nodes_filtered_cold_ms": round(cold_ms, 1),
        "one_claim_all_nodes_filtered_warm_ms_median": round(statistics.median(warm), 1),
        "one_claim_first_node_fits_ms": round(first_fit_ms, 2),
        "cel_evaluation_warm_us": round(cel_us, 2),
    }
    for k, v in figures.items():
        print(f"{k:45} {v}")
    out_path = Path(__file__).parent / "results" / "scheduler.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
