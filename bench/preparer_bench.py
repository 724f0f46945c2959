"""Preparer benchmark: 1-GPU prepare/unprepare latency (p50/p95/p99), fsyncs per cycle, sequential, batched and
concurrent claims per second, RSS over a soak, and tracing overhead (exporter on vs off), over the real unix
sockets, against the embedded API server, with each preparer as its own `gpu-dra preparer` process.

    .venv/bin/python bench/preparer_bench.py [--cycles 300] [--batch-rounds 40] [--concurrent-rounds 10]
        [--soak 10000] [--compare-repo /path/to/other/checkout [--compare-tracing]] [--out bench/results/preparer.json]

Variants run side by side and are interleaved cycle by cycle (the machine is noisy; medians of interleaved
runs compare): `main` (this checkout, no trace exporter), `tracing-on` (this checkout, spans exported to a
file) and, with --compare-repo, `compare` (another checkout's preparer, e.g. the commit before a change; with
--compare-tracing also `compare-tracing-on`, its spans exported: its tracing overhead in the same run).
fsyncs are read from each preparer's `gpu_dra_fsyncs_total` (its /metrics); RSS from /proc/<pid>/status.
Sequential cycles alternate between variants in blocks of 25 (`--interleave block`, the default since the fourth
round: a preparer's own events, sent 20 ms after a call, then land on its own next calls, not on another variant's)
or cycle by cycle (`--interleave cycle`). The API server runs as its own process (`--apiserver process`, the default
since the fourth round: a kubelet and kube-apiserver never share a process) or in the bench's own (`--apiserver
in-process`, the earlier rounds' method). Prints the figures and writes them to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.procstats import cpu_s, memory_mib  # noqa: E402
from embedded.apiserver.testing import running_apiserver  # noqa: E402
from embedded.kubelet.client import Claim, DraPlugin, register  # noqa: E402
from shared.kube.client import kube_api_client  # noqa: E402
from shared.ports import free_port  # noqa: E402
from tests.preparer.helpers import ApiClaims, claim_doc  # noqa: E402

# Sequential cycles run in blocks per variant (--interleave block): a preparer's own work after a call (its
# lifecycle events go out in a round 20 ms later, with their acks and outbox writes) then lands on its own next
# calls, as on a node, not on the next variant's; each block starts SETTLE_S after the one before.
SEQUENTIAL_BLOCK = 25
SETTLE_S = 0.1
GPUS = 64  # fake device nodes: enough for 64 concurrent one-GPU claims without overlap
BATCH = 8
CONCURRENT = 64
_FSYNC_LINE = re.compile(r'^gpu_dra_fsyncs_total\{what="(\w+)"\} ([0-9.e+]+)$', re.M)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(pct(values, 0.5) * 1000, 3),
        "p95_ms": round(pct(values, 0.95) * 1000, 3),
        "p99_ms": round(pct(values, 0.99) * 1000, 3),
        "mean_ms": round(statistics.fmean(values) * 1000, 3),
    }


@dataclass
class Variant:
    name: str
    repo: Path
    env: dict[str, str]
    args: list[str] = field(default_factory=list)  # more `gpu-dra preparer` flags
    root: Path = Path()
    port: int = 0
    proc: Any = None
    plugin: DraPlugin | None = None
    prepare_s: list[float] = field(default_factory=list)
    unprepare_s: list[float] = field(default_factory=list)
    fsyncs: dict[str, float] = field(default_factory=dict)

    def rss_mb(self) -> float:
        return memory_mib(self.proc.pid)[0]

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the preparer process has used so far: a figure the machine's
        load does not inflate the way it does wall-clock latency."""
        return cpu_s(self.proc.pid)

    def fsync_total(self) -> float | None:
        """The preparer's fsyncs so far (None: a preparer that does not count them, or serves no metrics)."""
        if not self.port:
            return None
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as reply:  # noqa: S310
            found = _FSYNC_LINE.findall(reply.read().decode())
        return sum(float(v) for _, v in found) if found else None


class ApiServerProcess:
    """`gpu-dra apiserver` as a process of its own, as kube-apiserver is to a kubelet: its request handling does
    not share a GIL and event loop with the bench's kubelet client."""

    def __init__(self, kubeconfig_path: Path) -> None:
        self.kubeconfig_path = kubeconfig_path

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[Any]:
        async with await kube_api_client(str(self.kubeconfig_path)) as api_client:
            yield api_client


@contextlib.asynccontextmanager
async def apiserver(base: Path, mode: str) -> AsyncIterator[Any]:
    """The embedded API server: in this process (`in-process`) or as its own process (`process`)."""
    if mode == "in-process":
        async with running_apiserver(base) as api:
            yield api
        return
    base.mkdir(parents=True)  # noqa: ASYNC240 - set-up, before any timing
    kubeconfig = base / "kubeconfig"
    log = open(base / "apiserver.log", "wb")  # noqa: ASYNC230, SIM115
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        "apiserver",
        "--port",
        str(free_port()),
        "--kubeconfig",
        str(kubeconfig),
        "--data-dir",
        str(base / "data"),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
    )
    log.close()
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            while b"apiserver listening" not in await proc.stdout.readline():
                assert proc.returncode is None, (base / "apiserver.log").read_text()[-3000:]
        yield ApiServerProcess(kubeconfig)
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), timeout=15)


async def sequential_and_batch_claims(claims: ApiClaims, cycles: int, batch_rounds: int) -> tuple[list[Any], list[Any]]:
    """The claims the sequential phase (one GPU each, all of gpu-0) and the batch phase (8 GPUs a round, at
    most 20 rounds, reused after) prepare, created in the API server."""
    singles = [await claims.add(claim_doc(name=f"one-{i}", results=[("gpu", "gpu-0")])) for i in range(cycles + 5)]
    batches = [
        [await claims.add(claim_doc(name=f"b{r}-{g}", results=[("gpu", f"gpu-{g}")])) for g in range(BATCH)]
        for r in range(min(batch_rounds, 20))
    ]
    return singles, batches


@contextlib.asynccontextmanager
async def running_preparer(variant: Variant, base: Path, kubeconfig: Path) -> AsyncIterator[Variant]:
    root = base / variant.name
    dev = root / "host" / "dev"
    dev.mkdir(parents=True)
    for name in [f"nvidia{i}" for i in range(GPUS)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]:
        (dev / name).touch()
    (root / "boot_id").write_text("bench-boot\n")
    variant.root, variant.port = root, free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_")}
    env.update(variant.env, PYTHONPATH=str(variant.repo))
    log = open(root / "preparer.log", "wb")  # noqa: ASYNC230, SIM115
    variant.proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        "preparer",
        "--node",
        "n1",
        "--registry-dir",
        str(root / "reg"),
        "--plugins-dir",
        str(root / "plugins"),
        "--cdi-dir",
        str(root / "cdi"),
        "--dev-root",
        str(root / "host"),
        "--boot-id-path",
        str(root / "boot_id"),
        "--kubeconfig",
        str(kubeconfig),
        "--metrics-port",
        str(variant.port),
        *variant.args,
        cwd=variant.repo,
        env=env,
        stdout=log,
        stderr=log,
    )
    log.close()
    async with registered(variant, root / "preparer.log"):
        yield variant


@contextlib.asynccontextmanager
async def registered(variant: Variant, log: Path) -> AsyncIterator[None]:
    """Once `variant.proc` (a kubelet plugin just started) has made its registration socket, the kubelet client
    registered with it as `variant.plugin`; on exit, the client closed and the process stopped (SIGTERM)."""
    reg = variant.root / "reg" / "gpu.nvidia.com-reg.sock"
    try:
        async with asyncio.timeout(60):
            while not reg.exists():
                assert variant.proc.returncode is None, log.read_text()[-3000:]  # noqa: ASYNC240 - its failure message
                await asyncio.sleep(0.05)
        variant.plugin = await register(reg)
        yield
    finally:
        if variant.plugin is not None:
            await variant.plugin.close()
        if variant.proc.returncode is None:
            variant.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(variant.proc.wait(), timeout=15)


async def cycle(plugin: DraPlugin, claim: Claim) -> tuple[float, float]:
    t0 = time.perf_counter()
    result = (await plugin.prepare([claim]))[claim.uid]
    t1 = time.perf_counter()
    errors = await plugin.unprepare([claim])
    t2 = time.perf_counter()
    assert result.error == "" and errors[claim.uid] == "", (result.error, errors)
    return t1 - t0, t2 - t1


async def batch_round(plugin: DraPlugin, claims: list[Claim]) -> None:
    results = await plugin.prepare(claims)
    assert all(r.error == "" for r in results.values()), results
    errors = await plugin.unprepare(claims)
    assert all(e == "" for e in errors.values()), errors


async def concurrent_round(plugin: DraPlugin, claims: list[Claim]) -> None:
    prepared = await asyncio.gather(*(plugin.prepare([c]) for c in claims))
    assert all(r[c.uid].error == "" for r, c in zip(prepared, claims, strict=True)), prepared
    unprepared = await asyncio.gather(*(plugin.unprepare([c]) for c in claims))
    assert all(e[c.uid] == "" for e, c in zip(unprepared, claims, strict=True)), unprepared


async def timed_phase(
    variants: list[Variant], rounds: int, claims_per_round: int, work: Any, claims: list[list[Claim]]
) -> dict[str, dict[str, float | None]]:
    """`rounds` rounds of `work(plugin, claims[r])`, interleaved across variants; claims/s and fsyncs per claim."""
    elapsed = dict.fromkeys((v.name for v in variants), 0.0)
    before = {v.name: v.fsync_total() for v in variants}
    for r in range(rounds):
        for v in variants:
            assert v.plugin is not None
            t0 = time.perf_counter()
            await work(v.plugin, claims[r % len(claims)])
            elapsed[v.name] += time.perf_counter() - t0
    out: dict[str, dict[str, float | None]] = {}
    for v in variants:
        after, start = v.fsync_total(), before[v.name]
        n = rounds * claims_per_round
        out[v.name] = {
            "claims_per_s": round(n / elapsed[v.name], 1),
            "fsyncs_per_cycle": round((after - start) / n, 3) if after is not None and start is not None else None,
        }
    return out


async def sequential_phase(
    variants: list[Variant], sequence: list[Claim], interleave: str
) -> dict[str, dict[str, Any]]:
    """One-claim prepare+unprepare cycles over `sequence` on every variant, in blocks of SEQUENTIAL_BLOCK
    (`interleave` "block") or one by one ("cycle"): latency percentiles, sequential claims/s, the process's CPU
    per cycle (/proc/<pid>/stat) and fsyncs per cycle."""
    out: dict[str, dict[str, Any]] = {}
    before = {v.name: v.fsync_total() for v in variants}
    cpu_before = {v.name: v.cpu_s() for v in variants}
    t_seq = dict.fromkeys((v.name for v in variants), 0.0)
    block = 1 if interleave == "cycle" else SEQUENTIAL_BLOCK
    for first in range(0, len(sequence), block):
        for v in variants:
            assert v.plugin is not None
            if block > 1:
                await asyncio.sleep(SETTLE_S)  # the variant before finishes its events' round
            for claim in sequence[first : first + block]:
                p, u = await cycle(v.plugin, claim)
                v.prepare_s.append(p)
                v.unprepare_s.append(u)
                t_seq[v.name] += p + u
    for v in variants:
        after, start = v.fsync_total(), before[v.name]
        out[v.name] = {
            "cycles": len(v.prepare_s),
            "prepare": ms(v.prepare_s),
            "unprepare": ms(v.unprepare_s),
            "prepare_plus_unprepare": ms([p + u for p, u in zip(v.prepare_s, v.unprepare_s, strict=True)]),
            "sequential_claims_per_s": round(len(v.prepare_s) / t_seq[v.name], 1),
            "preparer_cpu_ms_per_cycle": round((v.cpu_s() - cpu_before[v.name]) * 1000 / len(v.prepare_s), 2),
            "sequential_fsyncs_per_cycle": round((after - start) / len(v.prepare_s), 3)
            if after is not None and start is not None
            else None,
        }
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="gdb-", dir="/tmp"))  # noqa: S108 - short socket paths
    variants = [
        Variant("main", REPO, {}),
        Variant("tracing-on", REPO, {"GPU_DRA_OTEL_EXPORTER": f"file:{base / 'spans.jsonl'}"}),
    ]
    if args.compare_repo:
        variants.append(Variant("compare", Path(args.compare_repo), {}))
        if args.compare_tracing:  # the other checkout with its spans exported too: its own tracing overhead
            variants.append(
                Variant(
                    "compare-tracing-on",
                    Path(args.compare_repo),
                    {"GPU_DRA_OTEL_EXPORTER": f"file:{base / 'spans-compare.jsonl'}"},
                )
            )
    if args.tracing_first:  # each tree's exporter-on variant before its exporter-off one (the order's own bias)
        variants = [v for pair in zip(variants[1::2], variants[0::2], strict=False) for v in pair] + (
            variants[-1:] if len(variants) % 2 else []
        )
    figures_order = [v.name for v in variants]
    figures: dict[str, Any] = {
        "what": "1-GPU claims over the real DRA v1 unix socket; claims GET from the embedded API server; each "
        "preparer its own process (its embedded nats-server not counted in RSS); variants interleaved "
        "cycle by cycle",
        "cpus": os.cpu_count(),
        "apiserver": args.apiserver,
        "interleave": args.interleave,
        "order": figures_order,
    }
    try:
        async with (
            apiserver(base / "api", args.apiserver) as api,
            api.client() as client,
            contextlib.AsyncExitStack() as stack,
        ):
            claims = ApiClaims(client)
            singles, batches = await sequential_and_batch_claims(claims, args.cycles, args.batch_rounds)
            crowd = [
                await claims.add(claim_doc(name=f"c-{g}", results=[("gpu", f"gpu-{g}")])) for g in range(CONCURRENT)
            ]
            for v in variants:
                await stack.enter_async_context(running_preparer(v, base, api.kubeconfig_path))
            for v in variants:  # warm-up: version discovery, first connections, first writes
                assert v.plugin is not None
                for claim in singles[:5]:
                    await cycle(v.plugin, claim)
            figures["rss_mb_after_warmup"] = {v.name: round(v.rss_mb(), 1) for v in variants}
            sequential = await sequential_phase(variants, singles[5:], args.interleave)
            for v in variants:
                figures[v.name] = sequential[v.name]
            batched = await timed_phase(variants, args.batch_rounds, BATCH, batch_round, batches)
            concurrent = await timed_phase(variants, args.concurrent_rounds, CONCURRENT, concurrent_round, [crowd])
            for v in variants:
                figures[v.name]["batched"] = batched[v.name]
                figures[v.name]["concurrent"] = concurrent[v.name]
            main_v = next(v for v in variants if v.name == "main")

            def overhead(on: float, off: float, *, rate: bool = False) -> float:
                """How much worse exporter-on is, in % (negative: better, i.e. noise)."""
                return round(((off - on) / off if rate else (on - off) / off) * 100, 1)

            def tracing_overhead(on_v: dict[str, Any], off_v: dict[str, Any]) -> dict[str, float]:
                return {
                    "prepare_p50": overhead(on_v["prepare"]["p50_ms"], off_v["prepare"]["p50_ms"]),
                    "prepare_mean": overhead(on_v["prepare"]["mean_ms"], off_v["prepare"]["mean_ms"]),
                    "cpu_per_cycle": overhead(on_v["preparer_cpu_ms_per_cycle"], off_v["preparer_cpu_ms_per_cycle"]),
                    "batched_claims_per_s": overhead(
                        on_v["batched"]["claims_per_s"], off_v["batched"]["claims_per_s"], rate=True
                    ),
                    "concurrent_claims_per_s": overhead(
                        on_v["concurrent"]["claims_per_s"], off_v["concurrent"]["claims_per_s"], rate=True
                    ),
                }

            figures["tracing_overhead_pct"] = tracing_overhead(figures["tracing-on"], figures["main"])
            if "compare-tracing-on" in figures:
                figures["compare_tracing_overhead_pct"] = tracing_overhead(
                    figures["compare-tracing-on"], figures["compare"]
                )
            if args.soak:
                assert main_v.plugin is not None
                samples = [round(main_v.rss_mb(), 1)]
                pool = singles[5:] or singles
                for i in range(args.soak):
                    await cycle(main_v.plugin, pool[i % len(pool)])
                    if (i + 1) % max(1, args.soak // 10) == 0:
                        samples.append(round(main_v.rss_mb(), 1))
                figures["soak"] = {
                    "cycles": args.soak,
                    "rss_mb_samples": samples,
                    "rss_mb_end": samples[-1],
                    "rss_mb_growth_second_half": round(samples[-1] - samples[len(samples) // 2], 1),
                }
            figures["rss_mb_end"] = {v.name: round(v.rss_mb(), 1) for v in variants}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    figures["batch"] = f"{BATCH} claims per NodePrepareResources call, then one NodeUnprepareResources"
    figures["concurrent_calls"] = f"{CONCURRENT} one-claim NodePrepareResources calls at once, then as many unprepares"
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300, help="sequential prepare+unprepare cycles per variant")
    parser.add_argument("--batch-rounds", type=int, default=40, help="rounds of 8-claim calls per variant")
    parser.add_argument("--concurrent-rounds", type=int, default=10, help="rounds of 64 concurrent calls per variant")
    parser.add_argument("--soak", type=int, default=0, help="cycles of the RSS soak on `main` (0: no soak)")
    parser.add_argument(
        "--apiserver",
        choices=("process", "in-process"),
        default="process",
        help="the embedded API server as its own process (as kube-apiserver is) or in the bench's",
    )
    parser.add_argument(
        "--interleave",
        choices=("block", "cycle"),
        default="block",
        help=f"sequential cycles in blocks of {SEQUENTIAL_BLOCK} per variant, or one cycle per variant "
        "in turn (the earlier rounds' method: one preparer's events then go out during another's "
        "calls)",
    )
    parser.add_argument("--compare-repo", default="", help="another checkout whose preparer runs as `compare`")
    parser.add_argument(
        "--compare-tracing",
        action="store_true",
        help="with --compare-repo: that checkout with spans exported too (`compare-tracing-on`)",
    )
    parser.add_argument(
        "--tracing-first",
        action="store_true",
        help="run each tree's exporter-on variant before its exporter-off one in every round (the "
        "later variant of a pair runs a little faster here: run both orders and take both)",
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "preparer.json"))
    arguments = parser.parse_args()
    if arguments.compare_repo:
        arguments.compare_repo = str(Path(arguments.compare_repo).resolve())
    figures = asyncio.run(main(arguments))
    out = Path(arguments.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    print(f"written to {out}")
