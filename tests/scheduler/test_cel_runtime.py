"""Selectors cheap by their estimate but slow at runtime never stall the scheduler: they run in the CEL
worker under a CPU limit per evaluation (upstream's "actual cost limit exceeded" when spent), another
tenant's pod is bound within 1 s meanwhile, and a real `gpu-dra scheduler` process stops at once on
SIGTERM, taking its worker with it.

The slow selectors pass the API server's estimated-cost check (a few units each): `find` backtracks in
Python's `re` (exponential in the run of `a`s), `matches` recompiles a large regex in Rust on every
iteration while holding the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from embedded.cluster.explain import explain
from embedded.scheduler.cel import INLINE_COST, compile_selector
from embedded.scheduler.celcost import MAX_COST
from embedded.scheduler.celsandbox import INLINE_WORK, CelSandbox, offloaded
from embedded.scheduler.pools import SliceIndex
from embedded.scheduler.simslices import node_slices
from shared.kube.resources import EVENTS, PODS, RESOURCECLAIMS, RESOURCECLAIMTEMPLATES, Kube, Resource
from tests.scheduler.loophelpers import cluster
from tests.scheduler.test_loop import from_template, template

ROOT = Path(__file__).resolve().parents[2]
GPU = "device.driver == 'gpu.nvidia.com'"
ITEMS = "[" + ",".join(str(i) for i in range(300)) + "]"


def backtracking(run: int) -> str:
    """Python's `re` needs ~2^run steps to refuse `a...a!` against `^(a+)+$` (run 28: ~10 s)."""
    return f"{GPU} && '{'a' * run}!'.find('^(a+)+$') == ''"


RUST_REGEX = f"{GPU} && {ITEMS}.all(x, {ITEMS}.all(y, !'aaaa'.matches('(a{{100}}){{100}}')))"
COST_LIMIT = "cel evaluation error: operation cancelled: actual cost limit exceeded"


def test_which_selectors_leave_the_event_loop() -> None:
    fine = compile_selector(f"{GPU} && device.attributes['gpu.nvidia.com'].type == 'gpu'")
    assert fine.inline and fine.cost < 20
    for slow in (backtracking(28), RUST_REGEX):  # cheap by the estimate, slow in fact: regex functions
        selector = compile_selector(slow)
        assert selector.cost < MAX_COST and not selector.inline, (selector.cost, slow)
    dear = compile_selector(f"{ITEMS}.all(x, {ITEMS}.all(y, x != y || true))")
    assert INLINE_COST < dear.cost <= MAX_COST and not dear.inline
    # One over the API server's limit (stored before the check, or from another server) runs bounded too.
    assert not compile_selector(f"{ITEMS}.all(x, {ITEMS}.all(y, {ITEMS}.all(z, true)))").inline
    # Inline selectors too, when their cost times the devices they may meet is more than a plan may spend.
    light = compile_selector(f"{ITEMS}.exists(x, x == 7)")
    assert light.inline and light.cost * 100 > INLINE_WORK >= light.cost
    assert offloaded([fine, light], devices=1) == []
    assert offloaded([fine, light], devices=100) == [light]


@pytest.mark.parametrize("expression", [backtracking(30), RUST_REGEX], ids=["python-re", "rust-regex"])
async def test_worker_cuts_an_evaluation_at_its_cpu_limit(h100_inv: Any, expression: str) -> None:
    index = SliceIndex(node_slices(h100_inv))
    sandbox = CelSandbox(cpu_s=0.25)  # (results and failures stay cached in this process: texts used once)
    slow, fine = compile_selector(expression), compile_selector(f"{GPU} && '{len(expression)}'.matches('^[0-9]+$')")
    try:
        start = time.perf_counter()
        await sandbox.settle(slow, index)
        took = time.perf_counter() - start
        assert slow.failure is not None and slow.failure.message.startswith(COST_LIMIT), slow.failure
        assert "0.25 s of CPU" in slow.failure.message
        assert took < 5.0, f"cut after {took:.1f} s"
        # The next selector gets a fresh worker; one evaluation serves all the devices of one driver.
        await sandbox.settle(fine, index)
        envs = index.device_envs()
        assert fine.failure is None and sandbox.evaluations == len({env.driver for env in envs}) < len(envs)
        assert all(env.results[fine.expression] is (env.driver == "gpu.nvidia.com") for env in envs)
        assert all(env.results[slow.expression] is slow.failure for env in envs)  # failed on every device
    finally:
        await sandbox.close()


class Watch:
    """A resource's watch events from `rv` on, awaited by predicate (no polling)."""

    def __init__(self, kube: Kube, res: Resource, rv: str) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.task = asyncio.create_task(self._run(kube, res, rv))

    async def _run(self, kube: Kube, res: Resource, rv: str) -> None:
        async for _, obj in kube.watch(res, rv, timeout_s=120):
            self.queue.put_nowait(obj)

    async def until(self, match: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30.0) -> dict[str, Any]:
        try:
            async with asyncio.timeout(timeout):
                while True:
                    obj = await self.queue.get()
                    if match(obj):
                        return obj
        except TimeoutError:
            raise AssertionError(f"no {what} within {timeout} s") from None

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def watch(kube: Kube, res: Resource) -> Watch:
    _, rv = await kube.list(res)
    return Watch(kube, res, rv)


def bound(name: str) -> Callable[[dict[str, Any]], bool]:
    return lambda pod: pod["metadata"]["name"] == name and bool(pod["spec"].get("nodeName"))


def claim_of(pod: str) -> Callable[[dict[str, Any]], bool]:
    return lambda claim: claim["metadata"]["name"].startswith(f"{pod}-gpu-")


class SchedulerProcess:
    """A `gpu-dra scheduler` process; its log lines go to a file and can be awaited."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc, self.log = proc, log
        self.lines: asyncio.Queue[str] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("w") as out:
            async for raw in self.proc.stdout:
                line = raw.decode(errors="replace")
                out.write(line)
                out.flush()
                self.lines.put_nowait(line)

    async def line(self, needle: str, timeout: float = 30.0) -> str:
        try:
            async with asyncio.timeout(timeout):
                while needle not in (line := await self.lines.get()):
                    pass
                return line
        except TimeoutError:
            raise AssertionError(f"the scheduler logged no {needle!r} within {timeout} s") from None


@contextlib.asynccontextmanager
async def scheduler_process(kubeconfig: Path, log: Path, *flags: str) -> AsyncIterator[SchedulerProcess]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        "scheduler",
        "--kubeconfig",
        str(kubeconfig),
        *flags,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    running = SchedulerProcess(proc, log)
    try:
        yield running
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await running.reader


async def test_slow_selector_never_delays_another_tenants_pod(tmp_path: Path, h100_inv: Any) -> None:
    async with cluster(tmp_path, h100_inv, nodes=1, start=False) as c:
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("slow", selector=backtracking(28)))
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("one-gpu"))
        pods, claims, events = (
            await watch(c.kube, PODS),
            await watch(c.kube, RESOURCECLAIMS),
            await watch(c.kube, EVENTS),
        )
        try:
            async with scheduler_process(c.api.kubeconfig_path, tmp_path / "scheduler.log"):
                await c.pod("warm", from_template("one-gpu"))
                await pods.until(bound("warm"), "warm-up pod bound")  # the scheduler is up and synced
                await c.pod("evil", from_template("slow"))
                await claims.until(claim_of("evil"), "evil's claim generated")  # its selector is up next
                created = time.perf_counter()
                await c.pod("good", from_template("one-gpu"))
                await pods.until(bound("good"), "good pod bound")
                took = time.perf_counter() - created
                assert took < 1.0, f"another tenant's pod waited {took:.2f} s behind the slow selector"

                failed = await events.until(
                    lambda e: e["reason"] == "FailedScheduling" and e["involvedObject"]["name"] == "evil",
                    "evil's FailedScheduling",
                )
                assert COST_LIMIT in failed["message"] and "the evaluation used more than" in failed["message"]
                assert "selector `device.driver == 'gpu.nvidia.com' && 'aaaa" in failed["message"]
                assert (await c.get_pod("evil"))["spec"].get("nodeName") is None
                report = await explain("pod", "default", "evil", str(c.api.kubeconfig_path))
                assert COST_LIMIT in report, report
        finally:
            for w in (pods, claims, events):
                await w.close()


async def test_scheduler_process_stops_on_sigterm_while_a_selector_runs(tmp_path: Path, h100_inv: Any) -> None:
    async with cluster(tmp_path, h100_inv, nodes=1, start=False) as c:
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("slow", selector=backtracking(30)))
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("one-gpu"))
        pods, claims = await watch(c.kube, PODS), await watch(c.kube, RESOURCECLAIMS)
        log = tmp_path / "scheduler.log"
        try:
            # A CPU limit far above the ~40 s the evaluation needs: it is surely running at the signal.
            async with scheduler_process(c.api.kubeconfig_path, log, "--cel-cpu-seconds", "600") as sched:
                await c.pod("evil", from_template("slow"))
                await claims.until(claim_of("evil"), "evil's claim generated")
                started = await sched.line("evaluating a selector in the CEL worker", timeout=10)
                found = re.search(r"worker=(\d+)", started)
                assert found is not None, started
                worker = int(found.group(1))
                assert b"embedded.scheduler.celworker" in Path(f"/proc/{worker}/cmdline").read_bytes()
                await c.pod("good", from_template("one-gpu"))
                await pods.until(bound("good"), "good pod bound while evil's selector runs", timeout=10)

                sent = time.perf_counter()
                sched.proc.send_signal(signal.SIGTERM)
                code = await asyncio.wait_for(sched.proc.wait(), 30)
                took = time.perf_counter() - sent
                assert code == 0, log.read_text()[-3000:]
                assert took < 2.0, f"stopped {took:.2f} s after SIGTERM"
                assert not Path(f"/proc/{worker}").exists(), "the CEL worker outlived the scheduler"
        finally:
            await pods.close()
            await claims.close()
