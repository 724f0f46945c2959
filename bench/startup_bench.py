"""Start-up benchmark: the CPU a `gpu-dra` process spends before its command runs, and `gpu-dra up` to ready.

    .venv/bin/python bench/startup_bench.py [--rounds 6] [--commands kubelet,preparer,...] [--up-rounds 3]
        [--up-nodes 4] [--compare-repo /path/to/other/checkout] [--out bench/results/startup.json]

A start is `python -m shared.cli <command> --help`, run from the checkout (cwd and PYTHONPATH): the command's
module imported and its flags parsed, nothing served; its CPU (user + system) is the child's own, from wait4.
`up` is `gpu-dra up --nodes N` until it prints `ready:`, wall time, then SIGINT and its exit awaited. Variants
(this checkout, and another with --compare-repo, e.g. the commit before a change) alternate within each round,
their order swapped every other round; medians per variant and the ratio this/compare. Each variant's tree is
used as it is: whether its packages have bytecode (`make bytecode`) is recorded, not changed (the environment's
PYTHONDONTWRITEBYTECODE, when set, keeps a start from writing it). Prints the figures, writes them to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("apiserver", "kubelet", "preparer", "discovery", "publisher", "scheduler", "dashboard")
UP_TIMEOUT_S = 180.0


@dataclass
class Variant:
    name: str
    repo: Path
    starts: dict[str, list[float]] = field(default_factory=dict)  # command -> CPU seconds per start
    up_ready_s: list[float] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.repo)}

    def bytecode(self) -> bool:
        return any((self.repo / "shared" / "__pycache__").glob("cli.*.pyc"))


def start_cpu_s(variant: Variant, command: str) -> float:
    """CPU seconds of one `gpu-dra <command> --help` run from the variant's checkout."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", command, "--help"],
        cwd=variant.repo,
        env=variant.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant.name}: gpu-dra {command} --help exited {proc.returncode}")
    return usage.ru_utime + usage.ru_stime


def up_ready_s(variant: Variant, nodes: int) -> float:
    """Seconds from `gpu-dra up --nodes N`'s spawn to its `ready:` line; then SIGINT and its exit."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "up", "--nodes", str(nodes)],
        cwd=variant.repo,
        env=variant.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    stuck = threading.Timer(UP_TIMEOUT_S, proc.kill)  # a silent, stuck `up` ends the read below
    stuck.start()
    try:
        for line in proc.stdout:
            if line.startswith("ready:"):
                return time.monotonic() - started
        raise RuntimeError(f"{variant.name}: gpu-dra up printed no 'ready:' (exit {proc.poll()})")
    finally:
        stuck.cancel()
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    variants = [Variant("this", REPO)]
    if args.compare_repo:
        variants.append(Variant("compare", Path(args.compare_repo).resolve()))
    commands = [c for c in args.commands.split(",") if c]
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        for command in commands:
            for v in order:
                v.starts.setdefault(command, []).append(start_cpu_s(v, command))
    for rnd in range(args.up_rounds):
        for v in variants if rnd % 2 == 0 else variants[::-1]:
            v.up_ready_s.append(up_ready_s(v, args.up_nodes))
    figures: dict[str, Any] = {
        "what": "CPU of `gpu-dra <command> --help` (import + flags) per start, median ms; `gpu-dra up` to ready",
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "pythondontwritebytecode": bool(os.environ.get("PYTHONDONTWRITEBYTECODE")),
    }
    for v in variants:
        figures[v.name] = {
            "repo": str(v.repo),
            "bytecode": v.bytecode(),
            "start_cpu_ms": {c: median_ms(s) for c, s in v.starts.items()},
        }
        if v.up_ready_s:
            figures[v.name]["up_ready_s"] = round(statistics.median(v.up_ready_s), 2)
            figures[v.name]["up_ready_s_each"] = [round(s, 2) for s in v.up_ready_s]
    if len(variants) == 2:
        this, other = figures["this"], figures["compare"]
        figures["ratio_this_over_compare"] = {
            c: round(this["start_cpu_ms"][c] / other["start_cpu_ms"][c], 2) for c in commands
        }
        if args.up_rounds:
            figures["ratio_this_over_compare"]["up_ready"] = round(this["up_ready_s"] / other["up_ready_s"], 2)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="starts of each command per variant")
    parser.add_argument("--commands", default=",".join(COMMANDS), help="comma-separated gpu-dra commands")
    parser.add_argument("--up-rounds", type=int, default=3, help="`gpu-dra up` runs per variant (0: none)")
    parser.add_argument("--up-nodes", type=int, default=4)
    parser.add_argument("--compare-repo", default="", help="another checkout, run as `compare`")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "startup.json")
    args = parser.parse_args()
    figures = run(args)
    print(json.dumps(figures, indent=2))
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
