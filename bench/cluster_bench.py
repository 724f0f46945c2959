"""Local-cluster benchmark: pod created -> Running latency (p50/p99) for single-GPU pods on 4 nodes.

Everything is real: `gpu-dra up`'s processes (NATS, API server, publisher, scheduler, controllers,
and per node discovery, preparer and kubelet emulator). 4 nodes x 8 simulated H100s hold 32 GPUs,
so 100 pods run in waves of `--wave` (default 25): create a wave at once, time each pod from its
creation to Running+Ready (watch events), delete the wave, wait for its claims to be freed. Then
`--singles` pods one at a time: the latency of the path itself, without a burst's queue.

    .venv/bin/python bench/cluster_bench.py [--pods 100] [--wave 25] [--nodes 4] [--runtime sandbox|none]

It also reads the API server's request counters (`/metrics`) before and after the waves and reports
the requests per pod by verb and resource (the bench's own creates, deletes and polls included), and
the CPU time (user + system) each service of the cluster spent per pod over the waves (the nodes' instances
summed): on 2 cores shared by ~20 processes, CPU per pod is what moves the latency.

Prints the figures and writes them to bench/results/cluster.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.procstats import cpu_s  # noqa: E402
from embedded.cluster.local import ClusterConfig, LocalCluster  # noqa: E402
from shared.kube.resources import PODS, RESOURCECLAIMS, RESOURCECLAIMTEMPLATES, Kube  # noqa: E402
from shared.kube.rest import request  # noqa: E402

NS = "default"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"bench": "1"}},
        "spec": {
            "containers": [{"name": "ctr", "image": "ubuntu:22.04", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
        },
    }


async def request_counts(api: Any) -> dict[str, int]:
    """The API server's `apiserver_request_total`, as "VERB resource[/subresource]" -> requests served."""
    counts: dict[str, int] = {}
    for line in (await request(api, "GET", "/metrics")).decode().splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
        verb, res, sub = (labels[k].strip('"') for k in ("verb", "resource", "subresource"))
        key = f"{verb} {res}{'/' + sub if sub else ''}"
        counts[key] = counts.get(key, 0) + int(line.rsplit(" ", 1)[1])
    return counts


def cpu_seconds(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds (user + system) the cluster's processes used so far, by service (the nodes' summed)."""
    out: dict[str, float] = {}
    for child in cluster.supervisor.children if cluster.supervisor else []:
        try:
            used = cpu_s(child.pid)
        except (OSError, IndexError):
            continue
        service = re.sub(r"^gpu-node-\d+-", "", child.name)
        out[service] = out.get(service, 0.0) + used
    return out


def ready(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []
    )


async def wave(kube: Kube, names: list[str]) -> tuple[list[float], list[float]]:
    """(created -> Running+Ready, created -> bound) of each pod, in seconds."""
    _, rv = await kube.list(PODS, NS)
    created: dict[str, float] = {}
    latency: dict[str, float] = {}
    bound: dict[str, float] = {}

    async def watch_until_all_ready() -> None:
        version = rv
        while len(latency) < len(names):
            async for kind, obj in kube.watch(PODS, version, timeout_s=120):
                version = (obj.get("metadata") or {}).get("resourceVersion", version)
                name = (obj.get("metadata") or {}).get("name")
                if name in created and name not in bound and (obj.get("spec") or {}).get("nodeName"):
                    bound[name] = time.perf_counter() - created[name]
                if kind in ("ADDED", "MODIFIED") and name in created and name not in latency and ready(obj):
                    latency[name] = time.perf_counter() - created[name]
                if len(latency) == len(names):
                    return

    watcher = asyncio.create_task(watch_until_all_ready())
    for name in names:
        created[name] = time.perf_counter()
        await kube.create(PODS, NS, pod(name))
    await asyncio.wait_for(watcher, 300)
    for name in names:
        await kube.delete(PODS, NS, name)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the next wave needs the GPUs back
        pods, _ = await kube.list(PODS, NS, label_selector="bench=1")
        claims, _ = await kube.list(RESOURCECLAIMS, NS)
        if not pods and not any((c.get("status") or {}).get("allocation") for c in claims):
            break
        await asyncio.sleep(0.2)
    return [latency[n] for n in names], [bound.get(n, latency[n]) for n in names]


async def main(pods: int, wave_size: int, nodes: int, singles: int, runtime: str, data_dir: str) -> dict[str, Any]:
    cfg = ClusterConfig(nodes=nodes, gpus="h100x8", start_timeout=180, runtime=runtime, data_dir=data_dir)
    started = time.perf_counter()
    async with LocalCluster(cfg) as cluster:
        up_s = time.perf_counter() - started
        api = await cluster.api_client()
        kube = Kube(api)
        await kube.create(
            RESOURCECLAIMTEMPLATES,
            NS,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": "one-gpu", "namespace": NS},
                "spec": {
                    "spec": {
                        "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}
                    }
                },
            },
        )
        latencies: list[float] = []
        binds: list[float] = []
        waves: list[float] = []
        before = await request_counts(api)
        cpu_before = cpu_seconds(cluster)
        for start in range(0, pods, wave_size):
            names = [f"bench-{i}" for i in range(start, min(pods, start + wave_size))]
            t = time.perf_counter()
            running, scheduled = await wave(kube, names)
            latencies += running
            binds += scheduled
            waves.append(time.perf_counter() - t)
        after = await request_counts(api)
        cpu_after = cpu_seconds(cluster)
        cpu = {k: round((v - cpu_before.get(k, 0.0)) / pods * 1000, 1) for k, v in cpu_after.items()}
        # every request the waves cost (the bench's own creates, deletes and polls included), per pod
        per_pod = {
            k: round((after.get(k, 0) - before.get(k, 0)) / pods, 2)
            for k in sorted(after)
            if after.get(k, 0) - before.get(k, 0) >= pods / 10
        }
        single: list[float] = []  # one pod at a time: the path's own latency, without a burst's queue
        for i in range(singles):
            single += (await wave(kube, [f"bench-single-{i}"]))[0]
    return {
        "pods": pods,
        "nodes": nodes,
        "wave": wave_size,
        "runtime": cfg.runtime,
        "cluster_up_s": round(up_s, 2),
        "pod_running_p50_ms": round(pct(latencies, 0.5) * 1000, 1),
        "pod_running_p99_ms": round(pct(latencies, 0.99) * 1000, 1),
        "pod_running_mean_ms": round(statistics.fmean(latencies) * 1000, 1),
        "pod_bound_p50_ms": round(pct(binds, 0.5) * 1000, 1),
        "pod_bound_p99_ms": round(pct(binds, 0.99) * 1000, 1),
        "wave_median_s": round(statistics.median(waves), 2),
        "single_pods": singles,
        "single_pod_running_p50_ms": round(pct(single, 0.5) * 1000, 1) if single else None,
        "single_pod_running_p99_ms": round(pct(single, 0.99) * 1000, 1) if single else None,
        "api_requests_per_pod": round(sum(per_pod.values()), 1),
        "api_requests_per_pod_by_verb": per_pod,
        "cpu_ms_per_pod": round(sum(cpu.values()), 1),
        "cpu_ms_per_pod_by_service": dict(sorted(cpu.items(), key=lambda kv: -kv[1])),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--wave", type=int, default=25)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--singles", type=int, default=20, help="pods created one at a time after the waves")
    parser.add_argument(
        "--runtime",
        default="sandbox",
        choices=("sandbox", "none"),
        help="the kubelet emulators' container runtime (sandbox: bubblewrap, as `gpu-dra up`)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cluster.json")
    parser.add_argument("--data-dir", default="", help="keep the cluster's state and service logs (<dir>/logs) here")
    args = parser.parse_args()
    result = asyncio.run(main(args.pods, args.wave, args.nodes, args.singles, args.runtime, args.data_dir))
    print(json.dumps(result, indent=2))
    out = args.out
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out}")
