"""Preparer benchmark: 1-GPU prepare+unprepare latency (p50/p99) and prepares per second, over the real
unix sockets, against the embedded API server, with the preparer as its own `gpu-dra preparer` process.

    .venv/bin/python bench/preparer_bench.py [--cycles 300] [--batch-rounds 40]

Prints the figures and writes them to bench/results/preparer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from embedded.apiserver.testing import running_apiserver  # noqa: E402
from embedded.kubelet.client import Claim, register  # noqa: E402
from tests.preparer.helpers import ApiClaims, claim_doc  # noqa: E402

GPUS = 8


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(values, 0.5) * 1000, 3), "p99_ms": round(pct(values, 0.99) * 1000, 3),
            "mean_ms": round(statistics.fmean(values) * 1000, 3)}


async def main(cycles: int, batch_rounds: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="gdb-", dir="/tmp"))  # noqa: S108 - short socket paths
    dev = root / "host" / "dev"
    dev.mkdir(parents=True)
    for name in [f"nvidia{i}" for i in range(GPUS)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]:
        (dev / name).touch()
    (root / "boot_id").write_text("bench-boot\n")
    async with running_apiserver(root / "api") as api, api.client() as client:
        claims = ApiClaims(client)
        singles = [await claims.add(claim_doc(name=f"one-{i}", results=[("gpu", "gpu-0")])) for i in range(cycles)]
        batches: list[list[Claim]] = []
        for r in range(batch_rounds):
            batches.append([await claims.add(claim_doc(name=f"b{r}-{g}", results=[("gpu", f"gpu-{g}")]))
                            for g in range(GPUS)])
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_")}
        log = open(root / "preparer.log", "wb")  # noqa: ASYNC230, SIM115
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shared.cli", "preparer", "--node", "n1", "--registry-dir", str(root / "reg"),
            "--plugins-dir", str(root / "plugins"), "--cdi-dir", str(root / "cdi"), "--dev-root", str(root / "host"),
            "--boot-id-path", str(root / "boot_id"), "--kubeconfig", str(api.kubeconfig_path),
            cwd=REPO, env=env, stdout=log, stderr=log)
        log.close()
        reg = root / "reg" / "gpu.nvidia.com-reg.sock"
        try:
            async with asyncio.timeout(60):
                while not reg.exists():
                    await asyncio.sleep(0.05)
            plugin = await register(reg)
            # warm-up: version discovery, first connections
            for claim in singles[:5]:
                assert (await plugin.prepare([claim]))[claim.uid].error == ""
                await plugin.unprepare([claim])
            prepare_s, unprepare_s, pair_s = [], [], []
            start_all = time.perf_counter()
            for claim in singles[5:]:
                t0 = time.perf_counter()
                result = (await plugin.prepare([claim]))[claim.uid]
                t1 = time.perf_counter()
                errors = await plugin.unprepare([claim])
                t2 = time.perf_counter()
                assert result.error == "" and errors[claim.uid] == "", (result.error, errors)
                prepare_s.append(t1 - t0)
                unprepare_s.append(t2 - t1)
                pair_s.append(t2 - t0)
            sequential_elapsed = time.perf_counter() - start_all
            t0 = time.perf_counter()
            for batch in batches:
                results = await plugin.prepare(batch)
                assert all(r.error == "" for r in results.values())
                await plugin.unprepare(batch)
            batch_elapsed = time.perf_counter() - t0
            await plugin.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), timeout=15)
    shutil.rmtree(root, ignore_errors=True)
    measured = len(pair_s)
    return {
        "what": "1-GPU claim prepare+unprepare over the real DRA v1 unix socket; claims GET from the embedded "
                "API server; preparer in its own process (no NATS needed on this path)",
        "cycles": measured,
        "prepare": ms(prepare_s),
        "unprepare": ms(unprepare_s),
        "prepare_plus_unprepare": ms(pair_s),
        "sequential_prepares_per_s": round(measured / sequential_elapsed, 1),
        "batched_prepares_per_s": round(batch_rounds * GPUS / batch_elapsed, 1),
        "batch": f"{GPUS} claims per NodePrepareResources call, then one NodeUnprepareResources",
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--batch-rounds", type=int, default=40)
    args = parser.parse_args()
    figures = asyncio.run(main(args.cycles + 5, args.batch_rounds))
    out = REPO / "bench" / "results" / "preparer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    print(f"written to {out}")
