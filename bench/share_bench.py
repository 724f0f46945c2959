"""Share benchmark: prepare (and unprepare) of one more share of a GPU already shared vs of a whole GPU.

    .venv/bin/python bench/share_bench.py [--cycles 200] [--warmup 20] [--runs 1] [--residents 1]
        [--own-limits] [--out bench/results/share.json]

The harness of tests/preparer/test_shares.py: the preparer on its real unix sockets (gRPC from the kubelet
emulator), discovery in-process on simulated H100s running a fake driver root's binaries (tests/fakedriver.py)
over a real nats-server, claims in memory. gpu-0 keeps `--residents` shares (of other tenants) all along, so
its MPS daemon stays up and each new share has that many co-holders to be checked against; each `share` cycle
prepares and unprepares one more share of gpu-0 (a new claim each time), each `whole` cycle a claim of all of
gpu-1. Each cycle runs both kinds, in an order drawn from a seeded generator (the machine is noisy: medians of
interleaved cycles compare, and so does the median of each cycle's share/whole pair). Not a strict
alternation: its period (8 RPCs) divides the preparer's heap trim period (64 RPCs, host/server.py), so every
trim fell on the same kind of call, adding ~0.8 points to the ratio. Each share asks the residents' limits, so it
uses the CDI spec they use (services/preparer/host/sharedspecs.py); with --own-limits it asks limits of its own,
and so writes a spec at its prepare and removes it at its unprepare. Prints p50/p90 of each and the ratios;
writes them to --out (with --runs N, the last run's figures, each run's ratios, and their median and range
over the runs: a run's ratio moves by about a point from one run to the next).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from embedded.harness.discovery import running_discovery  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.natsserver import EmbeddedNats  # noqa: E402
from tests.fakedriver import make_driver_root  # noqa: E402
from tests.preparer.helpers import MemoryClaims, cleanup, running_node, short_root  # noqa: E402
from tests.preparer.test_shares import daemon_starts, share_doc  # noqa: E402

SEED = 20261206


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(values) * 1e3, 3),
        "p90_ms": round(pct(values, 0.9) * 1e3, 3),
        "n": len(values),
    }


async def run(cycles: int, warmup: int, residents: int = 1, own_limits: bool = False) -> dict[str, Any]:
    root = short_root()
    nats = EmbeddedNats(store_dir=root / "nats")
    await nats.start()
    bus = await Bus.connect(nats.url, name="share-bench")
    await bus.provision()
    fake = make_driver_root(root / "driver")
    timings: dict[str, dict[str, list[float]]] = {k: {"prepare": [], "unprepare": []} for k in ("share", "whole")}
    mps_starts = 0
    try:
        async with (
            running_discovery(
                bus, node="n1", simulate="h100x4", root=root / "sim", driver_root=str(fake.root), tool_timeout=5.0
            ) as _disc,
            running_node(claims := MemoryClaims(), root, bus=bus) as node,
        ):
            held = [claims.add(share_doc(f"resident-{n}", f"tenant-r{n}")) for n in range(residents)]
            for resident in held:
                assert (await node.plugin.prepare([resident]))[resident.uid].error == ""
            served = {"n": 0}

            async def counting(_msg: Any) -> None:  # a copy of each mps-start request discovery gets
                served["n"] += 1

            sub = await bus.nc.subscribe("dra.v1.device.n1.mps-start", cb=counting)
            order = random.Random(SEED)  # each cycle's order drawn, not alternated: see the module doc
            for i in range(warmup + cycles):
                for kind in order.sample(("share", "whole"), 2):
                    doc = (
                        share_doc(f"s-{i}", f"tenant-{i % 8}", compute="20" if own_limits else "10")
                        if kind == "share"
                        else share_doc(f"w-{i}", f"tenant-{i % 8}", device="gpu-1", share=False)
                    )
                    claim = claims.add(doc)
                    t0 = time.perf_counter()
                    got = await node.plugin.prepare([claim])
                    t1 = time.perf_counter()
                    assert got[claim.uid].error == "", got[claim.uid].error
                    undone = await node.plugin.unprepare([claim])
                    t2 = time.perf_counter()
                    assert undone == {claim.uid: ""}, undone
                    claims.delete(claim.namespace, claim.name)
                    if i >= warmup:
                        timings[kind]["prepare"].append(t1 - t0)
                        timings[kind]["unprepare"].append(t2 - t1)
            await bus.nc.flush()
            await sub.unsubscribe()
            mps_starts = served["n"]
            assert len(daemon_starts(fake)) == 1, "one daemon all along"
            assert (await node.plugin.unprepare(held)) == {r.uid: "" for r in held}
    finally:
        await bus.close()
        await nats.close()
        cleanup(root)
    out: dict[str, Any] = {k: {phase: summary(v) for phase, v in t.items()} for k, t in timings.items()}
    out["ratio_prepare_p50_share_over_whole"] = round(
        out["share"]["prepare"]["p50_ms"] / out["whole"]["prepare"]["p50_ms"], 3
    )
    out["ratio_unprepare_p50_share_over_whole"] = round(
        out["share"]["unprepare"]["p50_ms"] / out["whole"]["unprepare"]["p50_ms"], 3
    )
    for phase in ("prepare", "unprepare"):  # each cycle's share over the same cycle's whole: the noise of a
        # moment (another process on the 2 cores) hits both, so the median of the pairs is the steadier figure
        pairs = [s / w for s, w in zip(timings["share"][phase], timings["whole"][phase], strict=True)]
        out[f"paired_ratio_{phase}_p50"] = round(statistics.median(pairs), 3)
    out["mps_start_requests_per_share_cycle"] = round(mps_starts / (warmup + cycles), 3)
    out["cycles"], out["warmup"], out["residents"], out["cpus"] = cycles, warmup, residents, os.cpu_count()
    out["own_limits"] = own_limits
    return out


def runs_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The last run's figures, each run's ratios, and the median and range of each ratio over the runs."""
    out = dict(results[-1])
    keys = [k for k in out if k.startswith(("ratio_", "paired_ratio_"))]
    out["runs"] = [{k: r[k] for k in keys} for r in results]
    out["over_runs"] = {
        k: {
            "median": round(statistics.median(r[k] for r in results), 3),
            "range": [min(r[k] for r in results), max(r[k] for r in results)],
        }
        for k in keys
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=200, help="measured cycles of each kind")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument(
        "--residents", type=int, default=1, help="shares gpu-0 holds all along (7: eight tenants on one GPU)"
    )
    ap.add_argument("--runs", type=int, default=1, help="whole runs (a fresh node each), for the ratios' spread")
    ap.add_argument("--own-limits", action="store_true", help="shares ask limits no resident has (module doc)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "share.json"))
    args = ap.parse_args()
    results = []
    for _ in range(args.runs):
        result = asyncio.run(run(args.cycles, args.warmup, args.residents, args.own_limits))
        results.append(result)
        for kind in ("share", "whole"):
            p, u = result[kind]["prepare"], result[kind]["unprepare"]
            print(
                f"{kind:>5}: prepare p50 {p['p50_ms']:.2f} ms p90 {p['p90_ms']:.2f} ms | "
                f"unprepare p50 {u['p50_ms']:.2f} ms p90 {u['p90_ms']:.2f} ms  (n={p['n']})"
            )
        print(
            f"paired share/whole per cycle, median: prepare {result['paired_ratio_prepare_p50']:.3f}x, unprepare "
            f"{result['paired_ratio_unprepare_p50']:.3f}x"
        )
        print(
            f"prepare p50 share/whole: {result['ratio_prepare_p50_share_over_whole']:.2f}x; unprepare "
            f"{result['ratio_unprepare_p50_share_over_whole']:.2f}x; mps-start requests per share cycle "
            f"{result['mps_start_requests_per_share_cycle']}"
        )
    summary = runs_summary(results)
    if args.runs > 1:
        for key, over in summary["over_runs"].items():
            print(f"{key} over {args.runs} runs: median {over['median']:.3f}, range {over['range']}")
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
