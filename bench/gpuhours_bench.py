"""GPU-hours bench: the dashboard's per-namespace GPU-hours (services/dashboard/gpuhours.py) fed claim events
with many uses in the day's window, as a busy cloud's dashboard is fed by DRA_EVENTS.

For each `--uses` size: that many claims prepared and unprepared one second apart (all inside the 24 h window),
then `--events` more prepared/unprepared events, timed in `--reps` repetitions; the median microseconds per
event. `--repo DIR` imports the report from another checkout (an A/B against the tree before a change).

    .venv/bin/python bench/gpuhours_bench.py [--uses 1000 10000 100000] [--events 2000] [--reps 5]
        [--repo DIR] [--out bench/results/gpuhours.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
T0 = 1.8e9


def measure(uses: int, events: int, reps: int) -> dict[str, Any]:
    from services.dashboard.gpuhours import GpuHours
    from shared.events.claims import PreparedDeviceRef
    from tests.dashboard.claimevents import claim_use

    devices = [PreparedDeviceRef(request="gpu", pool="n1", device="gpu-0")]
    hours = GpuHours()
    for i in range(uses):
        hours.apply(claim_use("prepared", f"c{i}", T0 + i, devices))
        hours.apply(claim_use("unprepared", f"c{i}", T0 + i + 0.5, devices))
    per_event: list[float] = []
    for rep in range(reps):
        base = T0 + uses + rep * events
        kinds = ("prepared", "unprepared")
        batch = [claim_use(kinds[j % 2], f"r{rep}-{j // 2}", base + j, devices) for j in range(events)]
        start = time.perf_counter()
        for e in batch:
            hours.apply(e)
        per_event.append((time.perf_counter() - start) / events * 1e6)
    return {"uses_in_window": uses, "us_per_event_p50": round(statistics.median(per_event), 2), "reps": per_event}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--uses", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--events", type=int, default=2_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose report is measured")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpuhours.json")
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo.resolve()))
    rows = [measure(n, args.events, args.reps) for n in args.uses]
    for row in rows:
        row["reps"] = [round(r, 2) for r in row["reps"]]
        print(f"{row['uses_in_window']:>7} uses in the window: {row['us_per_event_p50']:.2f} us an event (p50)")
    out: dict[str, Any] = {"rows": rows}
    if args.repo.resolve() != REPO:
        out["repo"] = str(args.repo)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
