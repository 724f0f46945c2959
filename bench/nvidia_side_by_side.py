"""Our preparer beside NVIDIA's Go kubelet plugin (kubernetes-sigs/dra-driver-nvidia-gpu, `gpu-kubelet-plugin`) on
preparer_bench's harness: one-GPU prepare/unprepare p50 and batches of 8 claims, cycles interleaved, ratios
ours/NVIDIA's, and each process's CPU.

    .venv/bin/python bench/nvidia_side_by_side.py --nvidia-plugin /work/nvidia-build/gpu-kubelet-plugin \\
        --mock-nvml /work/nvidia-build/k8s-test-infra/pkg/gpu/mocknvml/libnvidia-ml.so.550.163.01 \\
        [--cycles 300] [--batch-rounds 40] [--interleave block|cycle] [--nvidia-verbosity 4] [--nvidia-env K=V]

Neither NVIDIA's plugin nor the mock NVML is in this repo: bench/README.md says how to build both outside it.
Both plugins get the same fake driver root (tests/fakedriver.py, 8 GPUs, NVIDIA's mock NVML as its
libnvidia-ml.so.1, which NVIDIA's plugin loads: its GPUs, and so its device names gpu-0..gpu-7, come from it), so
both write CDI specs carrying the driver's userspace; the same embedded API server as its own process (a Node `n1`,
claims allocated there); and the same kubelet client (embedded/kubelet/client.py) over each plugin's own
registration and DRA unix sockets. NVIDIA's plugin runs as its chart runs it (`-v 4`, the chart's logVerbosity;
feature gates at their defaults), its log to a file. It publishes its ResourceSlices for `n1`, which nothing here
reads. The sequential and batch phases are preparer_bench's (`sequential_phase`, `timed_phase`), so the two benches
measure the same thing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import stat
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.preparer_bench import (  # noqa: E402
    BATCH,
    Variant,
    apiserver,
    batch_round,
    cycle,
    registered,
    running_preparer,
    sequential_and_batch_claims,
    sequential_phase,
    timed_phase,
)
from tests.fakedriver import make_driver_root  # noqa: E402
from tests.preparer.helpers import ApiClaims  # noqa: E402

NODE = "n1"
MOCK_GPUS = 8  # NVIDIA's mock NVML simulates at most 8 GPUs
DEFAULT_DRIVER_VERSION = "550.163.01"  # the mock's default (its Makefile's LIB_VERSION)
NVIDIA_MAJOR, UVM_MAJOR = 195, 511  # the driver's character device majors (nvidia-uvm's is dynamic)
CDI_HOOK = "/usr/bin/nvidia-cdi-hook"  # named in both plugins' CDI hooks; never run here
# Issue 32's bar, issue 33's goals (ours / NVIDIA's for times; ours / NVIDIA's for rates).
GOALS = {
    "prepare_p50_at_most": {"issue 32": 0.8, "issue 33": 0.5},
    "unprepare_p50_at_most": {"issue 33": 0.5},
    "batch_claims_per_s_at_least": {"issue 33": 5.0},
}


def lay_driver_root(base: Path, mock_nvml: Path, version: str) -> Path:
    """tests/fakedriver's driver root for `version` (8 GPUs), its libnvidia-ml.so.<version> replaced by the mock
    NVML library (SONAME libnvidia-ml.so.1, the link the root already has)."""
    fake = make_driver_root(base, version=version, gpus=MOCK_GPUS)
    lib = fake.root / fake.lib_dir.lstrip("/") / f"libnvidia-ml.so.{version}"
    lib.unlink()
    shutil.copyfile(mock_nvml, lib)
    lib.chmod(0o755)
    # NVIDIA's CDI code (the container toolkit's) takes only character devices as device nodes; a GPU without
    # one gets an empty device and no CDI spec. The fake root's stand-ins become real nodes (mknod: root only).
    dev = fake.root / "dev"
    for name, (major, minor) in {
        **{f"nvidia{i}": (NVIDIA_MAJOR, i) for i in range(MOCK_GPUS)},
        "nvidiactl": (NVIDIA_MAJOR, 255),
        "nvidia-modeset": (NVIDIA_MAJOR, 254),
        "nvidia-uvm": (UVM_MAJOR, 0),
        "nvidia-uvm-tools": (UVM_MAJOR, 1),
    }.items():
        (dev / name).unlink(missing_ok=True)
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    return fake.root


def mock_version(mock_nvml: Path) -> str:
    """The driver version the mock library's file name carries (libnvidia-ml.so.550.163.01), else the default."""
    name = mock_nvml.resolve().name
    suffix = name.removeprefix("libnvidia-ml.so.")
    return suffix if suffix != name and suffix.count(".") >= 1 else DEFAULT_DRIVER_VERSION


@contextlib.asynccontextmanager
async def running_nvidia_plugin(
    variant: Variant, base: Path, kubeconfig: Path, driver_root: Path, verbosity: int, qps: str, burst: str
) -> AsyncIterator[Variant]:
    """NVIDIA's gpu-kubelet-plugin (`variant.repo` is its binary) with its flags' environment variables, as its
    chart sets them, pointed at this bench's directories; registered with the kubelet client like ours."""
    root = base / variant.name
    (root / "reg").mkdir(parents=True)  # the kubelet's: the plugin does not make it
    variant.root, variant.port = root, 0  # port 0: no gpu_dra_fsyncs_total to read
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_DRA_", "KUBECONFIG", "NVIDIA_"))}
    env.update(
        NODE_NAME=NODE,
        NAMESPACE="default",
        IMAGE_NAME="bench.invalid/dra-driver-nvidia-gpu:bench",  # required; only MPS daemon templates use it
        KUBECONFIG=str(kubeconfig),
        CDI_ROOT=str(root / "cdi"),
        NVIDIA_DRIVER_ROOT=str(driver_root),
        DRIVER_ROOT_CTR_PATH=str(driver_root),
        NVIDIA_CDI_HOOK_PATH=CDI_HOOK,
        NVIDIA_VISIBLE_DEVICES="void",
        NVIDIA_MIG_CONFIG_DEVICES="all",
        KUBELET_REGISTRAR_DIRECTORY_PATH=str(root / "reg"),
        KUBELET_PLUGINS_DIRECTORY_PATH=str(root / "plugins"),
        KUBE_API_QPS=qps,
        KUBE_API_BURST=burst,
    )
    env.update(variant.env)
    log = open(root / "plugin.log", "wb")  # noqa: ASYNC230, SIM115
    variant.proc = await asyncio.create_subprocess_exec(
        str(variant.repo), "-v", str(verbosity), *variant.args, env=env, stdout=log, stderr=log
    )
    log.close()
    async with registered(variant, root / "plugin.log"):
        yield variant


async def ensure_node(client: Any, name: str) -> None:
    """NVIDIA's plugin owns its ResourceSlices by its Node, which it reads at start."""
    from kubernetes_asyncio.client import CoreV1Api

    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
    await CoreV1Api(client).create_node(node)  # type: ignore[arg-type]  # sent as it is


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of `pid` and its live descendants: our preparer's embedded nats-server, which
    carries its lifecycle events, counts against it (NVIDIA's plugin starts none)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        total += ticks.get(current, 0)
        todo += children.get(current, [])
    return total / os.sysconf("SC_CLK_TCK")


def keep_logs(base: Path, dest: Path) -> None:
    """Each process's log of the run in `base`, copied to `dest` as <run dir>-<process>.log."""
    dest.mkdir(parents=True, exist_ok=True)
    for log in ("ours/preparer.log", "nvidia/plugin.log", "api/apiserver.log"):
        with contextlib.suppress(FileNotFoundError):
            shutil.copyfile(base / log, dest / f"{base.name}-{log.replace('/', '-')}")


def ratio(ours: float, theirs: float) -> float:
    return round(ours / theirs, 3) if theirs else float("nan")


async def run_once(args: argparse.Namespace, state_root: str, nvidia_first: bool) -> dict[str, Any]:
    """One run: both plugins started afresh, their state (checkpoints, CDI specs, sockets) under `state_root`."""
    base = Path(tempfile.mkdtemp(prefix="gnv-", dir=state_root))  # short socket paths
    mock = Path(args.mock_nvml)
    version = args.driver_version or mock_version(mock)
    driver_root = lay_driver_root(base / "driver", mock, version)
    extra_env = dict(kv.split("=", 1) for kv in args.nvidia_env)
    ours = Variant("ours", REPO, {}, args=["--driver-root", str(driver_root)])
    nvidia = Variant("nvidia", Path(args.nvidia_plugin), extra_env)
    variants = [nvidia, ours] if nvidia_first else [ours, nvidia]
    figures: dict[str, Any] = {
        "what": "1-GPU claims over the real DRA v1 unix socket, the claim read from the embedded API server (its own "
        "process); our preparer vs NVIDIA's gpu-kubelet-plugin, both on one fake driver root whose "
        "libnvidia-ml.so.1 is NVIDIA's mock NVML; cycles interleaved; CPU of each plugin's process from "
        "/proc/<pid>/stat (our embedded nats-server not counted)",
        "state_root": state_root,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "order": [v.name for v in variants],
    }
    try:
        async with (
            apiserver(base / "api", "process") as api,
            api.client() as client,
            contextlib.AsyncExitStack() as stack,
        ):
            await ensure_node(client, NODE)
            claims = ApiClaims(client)
            singles, batches = await sequential_and_batch_claims(claims, args.cycles, args.batch_rounds)
            await stack.enter_async_context(running_preparer(ours, base, api.kubeconfig_path))
            await stack.enter_async_context(
                running_nvidia_plugin(
                    nvidia,
                    base,
                    api.kubeconfig_path,
                    driver_root,
                    args.nvidia_verbosity,
                    args.nvidia_kube_api_qps,
                    args.nvidia_kube_api_burst,
                )
            )
            for v in variants:  # warm-up: first connections, first checkpoint and CDI writes
                assert v.plugin is not None
                for claim in singles[:5]:
                    await cycle(v.plugin, claim)
                await batch_round(v.plugin, batches[0])
            figures["rss_mb_after_warmup"] = {v.name: round(v.rss_mb(), 1) for v in variants}
            t0 = time.monotonic()
            tree_before = {v.name: tree_cpu_s(v.proc.pid) for v in variants}
            sequential = await sequential_phase(variants, singles[5:], args.interleave)
            tree_between = {v.name: tree_cpu_s(v.proc.pid) for v in variants}
            cpu_before = {v.name: v.cpu_s() for v in variants}
            batched = await timed_phase(variants, args.batch_rounds, BATCH, batch_round, batches)
            claims_batched = args.batch_rounds * BATCH
            for v in variants:
                tree_after = tree_cpu_s(v.proc.pid)
                figures[v.name] = sequential[v.name]
                figures[v.name]["cpu_ms_per_cycle_with_children"] = round(
                    (tree_between[v.name] - tree_before[v.name]) * 1000 / args.cycles, 2
                )
                figures[v.name]["batched"] = batched[v.name]
                figures[v.name]["batched"]["cpu_ms_per_claim"] = round(
                    (v.cpu_s() - cpu_before[v.name]) * 1000 / claims_batched, 3
                )
                figures[v.name]["batched"]["cpu_ms_per_claim_with_children"] = round(
                    (tree_after - tree_between[v.name]) * 1000 / claims_batched, 3
                )
            figures["rss_mb_end"] = {v.name: round(v.rss_mb(), 1) for v in variants}
            figures["seconds_timed"] = round(time.monotonic() - t0, 1)
    finally:
        figures["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        if args.keep_logs:
            keep_logs(base, Path(args.keep_logs))
        shutil.rmtree(base, ignore_errors=True)
    o, n = figures["ours"], figures["nvidia"]
    ratios = {
        "prepare_p50": ratio(o["prepare"]["p50_ms"], n["prepare"]["p50_ms"]),
        "prepare_p95": ratio(o["prepare"]["p95_ms"], n["prepare"]["p95_ms"]),
        "unprepare_p50": ratio(o["unprepare"]["p50_ms"], n["unprepare"]["p50_ms"]),
        "prepare_plus_unprepare_p50": ratio(
            o["prepare_plus_unprepare"]["p50_ms"], n["prepare_plus_unprepare"]["p50_ms"]
        ),
        "cpu_per_cycle": ratio(o["preparer_cpu_ms_per_cycle"], n["preparer_cpu_ms_per_cycle"]),
        "cpu_per_cycle_with_children": ratio(o["cpu_ms_per_cycle_with_children"], n["cpu_ms_per_cycle_with_children"]),
        "batch_claims_per_s": ratio(o["batched"]["claims_per_s"], n["batched"]["claims_per_s"]),
        "batch_cpu_per_claim": ratio(o["batched"]["cpu_ms_per_claim"], n["batched"]["cpu_ms_per_claim"]),
    }
    figures["ours_over_nvidia"] = ratios
    return figures


def goals_met(ratios: dict[str, float]) -> dict[str, bool]:
    met = {
        f"prepare_p50 <= {bar}x ({who})": ratios["prepare_p50"] <= bar
        for who, bar in GOALS["prepare_p50_at_most"].items()
    }
    met.update(
        {
            f"unprepare_p50 <= {bar}x ({who})": ratios["unprepare_p50"] <= bar
            for who, bar in GOALS["unprepare_p50_at_most"].items()
        }
    )
    met.update(
        {
            f"batch_claims_per_s >= {bar}x ({who})": ratios["batch_claims_per_s"] >= bar
            for who, bar in GOALS["batch_claims_per_s_at_least"].items()
        }
    )
    return met


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over runs: each plugin's headline figures, the ratios, and the goals judged on the median ratios."""

    def med(values: Any) -> float:
        return round(float(statistics.median(values)), 3)

    plugins = {
        name: {
            "prepare_p50_ms": med(r[name]["prepare"]["p50_ms"] for r in runs),
            "prepare_p95_ms": med(r[name]["prepare"]["p95_ms"] for r in runs),
            "unprepare_p50_ms": med(r[name]["unprepare"]["p50_ms"] for r in runs),
            "cpu_ms_per_cycle": med(r[name]["preparer_cpu_ms_per_cycle"] for r in runs),
            "cpu_ms_per_cycle_with_children": med(r[name]["cpu_ms_per_cycle_with_children"] for r in runs),
            "batch_claims_per_s": med(r[name]["batched"]["claims_per_s"] for r in runs),
            "batch_cpu_ms_per_claim": med(r[name]["batched"]["cpu_ms_per_claim"] for r in runs),
            "batch_cpu_ms_per_claim_with_children": med(
                r[name]["batched"]["cpu_ms_per_claim_with_children"] for r in runs
            ),
            "rss_mb_end": med(r["rss_mb_end"][name] for r in runs),
        }
        for name in ("ours", "nvidia")
    }
    ratios = {key: med(r["ours_over_nvidia"][key] for r in runs) for key in runs[0]["ours_over_nvidia"]}
    return {
        "runs": len(runs),
        "cycles_per_plugin": sum(r["ours"]["cycles"] for r in runs),
        **plugins,
        "ours_over_nvidia": ratios,
        "ours_over_nvidia_range": {
            key: [min(r["ours_over_nvidia"][key] for r in runs), max(r["ours_over_nvidia"][key] for r in runs)]
            for key in ratios
        },
        "goals_met": goals_met(ratios),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """`--repeat` runs per state root, roots taken in turn, the plugins' order swapped every other run."""
    figures: dict[str, Any] = {
        "what": "1-GPU claims over the real DRA v1 unix socket, the claim read from the embedded API server (its own "
        "process); our preparer vs NVIDIA's gpu-kubelet-plugin, both on one fake driver root whose "
        "libnvidia-ml.so.1 is NVIDIA's mock NVML; cycles interleaved; CPU of each plugin's process from "
        "/proc/<pid>/stat (our embedded nats-server not counted); medians over runs",
        "cpus": os.cpu_count(),
        "interleave": args.interleave,
        "nvidia_verbosity": args.nvidia_verbosity,
        "nvidia_kube_api_qps_burst": [args.nvidia_kube_api_qps, args.nvidia_kube_api_burst],
        "nvidia_env": dict(kv.split("=", 1) for kv in args.nvidia_env),
        "batch": f"{BATCH} claims (gpu-0..gpu-{BATCH - 1}) per NodePrepareResources call, then one unprepare",
        "by_state_root": {},
    }
    runs: dict[str, list[dict[str, Any]]] = {root: [] for root in args.state_root}
    for i in range(args.repeat):
        for root in args.state_root:
            runs[root].append(await run_once(args, root, args.nvidia_first != (i % 2 == 1)))
            print(f"run {i + 1}/{args.repeat} in {root}: {runs[root][-1]['ours_over_nvidia']}", file=sys.stderr)
    for root, done in runs.items():
        figures["by_state_root"][root] = {"summary": summary(done), "runs": done}
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvidia-plugin", required=True, help="NVIDIA's gpu-kubelet-plugin binary")
    parser.add_argument("--mock-nvml", required=True, help="NVIDIA's mock libnvidia-ml.so.<version> (k8s-test-infra)")
    parser.add_argument("--driver-version", default="", help="the mock's driver version (default: its file name's)")
    parser.add_argument("--cycles", type=int, default=300, help="sequential prepare+unprepare cycles per plugin")
    parser.add_argument("--batch-rounds", type=int, default=40, help="rounds of 8-claim calls per plugin")
    parser.add_argument(
        "--interleave", choices=("block", "cycle"), default="block", help="as preparer_bench's --interleave"
    )
    parser.add_argument("--nvidia-first", action="store_true", help="NVIDIA's plugin first in every round")
    parser.add_argument(
        "--nvidia-verbosity", type=int, default=4, help="NVIDIA's klog -v (its chart's logVerbosity is 4)"
    )
    parser.add_argument(
        "--nvidia-kube-api-qps",
        default="1000",
        help="NVIDIA's KUBE_API_QPS: its default (and its chart's) is 5, which holds its prepares, one claim GET "
        "each, to 5 a second once its burst is spent; 1000 takes that limiter out of a per-call comparison",
    )
    parser.add_argument("--nvidia-kube-api-burst", default="1000", help="NVIDIA's KUBE_API_BURST (its default: 10)")
    parser.add_argument(
        "--nvidia-env",
        action="append",
        default=[],
        metavar="K=V",
        help="more environment for NVIDIA's plugin (e.g. MOCK_NVML_CONFIG=<profile>.yaml, FEATURE_GATES=...)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per state root (order swapped every other)")
    parser.add_argument(
        "--state-root",
        action="append",
        default=[],
        help="where both plugins keep their state (checkpoints, CDI specs, sockets); repeatable (default /tmp). "
        "NVIDIA's plugin fsyncs its checkpoint twice per prepare, ours does not: /dev/shm takes the disk out",
    )
    parser.add_argument("--keep-logs", default="", help="copy each process's log into this directory at the end")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "nvidia_side_by_side.json"))
    arguments = parser.parse_args()
    arguments.state_root = arguments.state_root or ["/tmp"]  # noqa: S108 - short socket paths
    figures = asyncio.run(main(arguments))
    out = Path(arguments.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    print(f"written to {out}")
