"""Selector evaluations kept off the scheduler's event loop: which ones, and the worker that runs them.

Owns the choice, made before a pod is planned, of the selectors to evaluate in the CEL worker
(`offloaded`): every selector that may not run inline (`Selector.inline`: estimated cost over
`cel.INLINE_COST`, or a regex function), then the dearest inline ones until the rest, times the
devices they may meet, cost at most INLINE_WORK per pod: a check of estimated cost before anything
runs, so that planning one pod spends at most ~0.1 s on CEL however many devices there are. It
also owns the persistent worker process (`celworker`: started on first need, replaced when it ends,
killed on close) and settling a selector over a SliceIndex: every device without a result gets
one from the worker (one evaluation per group of devices that agree on the fields it reads), so
the allocator then only reads results. An evaluation that runs past the worker's CPU limit ends
the worker; the selector then fails with upstream's "actual cost limit exceeded" on every device.
A worker that stops answering without spending CPU (WALL_LIMIT_S), or a selector whose evaluations
over the cluster take more than BATCH_BUDGET_S in all, fails the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import weakref
from collections.abc import Iterable
from typing import Any

from embedded.scheduler import celworker
from embedded.scheduler.cel import COST_LIMIT_MESSAGE, CelError, DeviceEnv, Selector
from embedded.scheduler.pools import SliceIndex
from shared.logs import get_logger
from shared.parentdeath import with_parent_death_signal

log = get_logger(__name__)
INLINE_WORK = 100_000  # estimated cost units one pod's plan may spend on selectors on the event loop
WALL_LIMIT_S = 10.0  # one evaluation, however loaded the machine (the CPU limit normally ends it first)
BATCH_BUDGET_S = 10.0  # one selector over every device of the cluster
START_S = 60.0  # the worker's start (imports), however loaded the machine
FEED_CHUNK = 64  # device variables built between two yields to the event loop


def offloaded(selectors: Iterable[Selector], devices: int) -> list[Selector]:
    """The selectors to evaluate in the worker before planning, for a cluster of `devices` devices."""
    unique = {s.expression: s for s in selectors}
    heavy = [s for s in unique.values() if not s.inline]
    light = sorted((s for s in unique.values() if s.inline), key=lambda s: s.cost, reverse=True)
    work = sum(s.cost for s in light) * devices
    for selector in light:
        if work <= INLINE_WORK:
            break
        heavy.append(selector)
        work -= selector.cost * devices
    return heavy


class _WorkerEnded(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class CelSandbox:
    """The scheduler's CEL worker: `unsettled` says what a pod waits for, `settle` evaluates it."""

    def __init__(
        self, cpu_s: float = celworker.CPU_LIMIT_S, wall_s: float = WALL_LIMIT_S, budget_s: float = BATCH_BUDGET_S
    ) -> None:
        self.cpu_s, self.wall_s, self.budget_s = cpu_s, wall_s, budget_s
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._settled: weakref.WeakKeyDictionary[SliceIndex, set[str]] = weakref.WeakKeyDictionary()
        self.evaluations = 0  # evaluations the worker answered (for tests and logs)

    def unsettled(self, selectors: Iterable[Selector], index: SliceIndex) -> list[Selector]:
        """The selectors to evaluate in the worker before a pod using them is planned on `index`."""
        done = self._settled.get(index, set())
        return [
            s for s in offloaded(selectors, len(index.device_envs())) if s.failure is None and s.expression not in done
        ]

    async def settle(self, selector: Selector, index: SliceIndex) -> None:
        """Give every device of `index` a result for `selector` (evaluated in the worker, one at a time)."""
        async with self._lock:
            if selector.failure is None and selector.expression not in self._settled.get(index, set()):
                await self._settle(selector, index)
            self._settled.setdefault(index, set()).add(selector.expression)

    async def close(self) -> None:
        """Kill the worker (a running evaluation included) and reap it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            await _kill(proc)

    # ---- settling ---------------------------------------------------------------------------------

    async def _settle(self, selector: Selector, index: SliceIndex) -> None:
        groups = _unevaluated(selector, index.device_envs())
        if not groups:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.budget_s
        answered = 0
        try:
            proc = await self._worker()
            assert proc.stdin is not None and proc.stdout is not None
            log.info(
                "evaluating a selector in the CEL worker",
                worker=proc.pid,
                evaluations=len(groups),
                expression=selector.expression[:120],
            )
            feeder = asyncio.create_task(self._feed(proc, selector, groups))
            try:
                for key, envs in groups:
                    line = await self._answer(proc, min(self.wall_s, deadline - loop.time()))
                    value = celworker.outcome(line, selector.expression)
                    self.evaluations += 1
                    for env in envs:
                        env.remember(selector, key, value)
                    answered += 1
            finally:
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                    await feeder
        except TimeoutError:
            await self.close()
            spent = loop.time() >= deadline
            what = "its evaluations over the cluster's devices took" if spent else "an evaluation took"
            self._fail(
                selector,
                f"{COST_LIMIT_MESSAGE} ({what} more than {self.budget_s if spent else self.wall_s:g} s)",
                groups[answered:],
            )
        except _WorkerEnded as exc:
            self._fail(selector, exc.message, groups[answered:])
        except asyncio.CancelledError:
            await self.close()  # the evaluation in flight must not outlive the scheduler
            raise

    async def _feed(
        self, proc: asyncio.subprocess.Process, selector: Selector, groups: list[tuple[Any, list[DeviceEnv]]]
    ) -> None:
        """Write the batch while the answers are read (a stuck worker stops reading: the pipe fills),
        building the device variables a chunk at a time between which the loop runs other work."""
        assert proc.stdin is not None
        proc.stdin.write(celworker.header(selector.expression, len(groups), self.cpu_s))
        for i, (_, envs) in enumerate(groups, 1):
            proc.stdin.write(celworker.device_line(envs[0].variables_for(selector)))
            if i % FEED_CHUNK == 0:
                await proc.stdin.drain()
                await asyncio.sleep(0)  # a yield, not a wait: other pods are planned meanwhile
        await proc.stdin.drain()

    async def _answer(self, proc: asyncio.subprocess.Process, timeout: float) -> bytes:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), max(timeout, 0.0))
        if line:
            return line
        code = await proc.wait()
        self._proc = None
        raise _WorkerEnded(celworker.ended_message(code, self.cpu_s))

    def _fail(self, selector: Selector, message: str, unanswered: list[tuple[Any, list[DeviceEnv]]]) -> None:
        """The selector fails from now on, and on every device still without a result (also for a later
        compile of the same text: the devices keep the failure)."""
        selector.failure = CelError(selector.expression, message)
        for key, envs in unanswered:
            for env in envs:
                env.remember(selector, key, selector.failure)
        log.warning("CEL selector failed its runtime limit", expression=selector.expression[:200], error=message)

    async def _worker(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        try:
            proc = await asyncio.create_subprocess_exec(
                *with_parent_death_signal(celworker.argv(), signal.SIGKILL),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=None,
            )
        except OSError as exc:
            raise _WorkerEnded(f"the CEL worker did not start: {exc}") from None
        assert proc.stdout is not None
        try:
            ready = await asyncio.wait_for(proc.stdout.readline(), START_S)
        except BaseException as exc:
            await _kill(proc)
            if isinstance(exc, TimeoutError):
                raise _WorkerEnded(f"the CEL worker did not start within {START_S:g} s") from None
            raise
        if ready != celworker.READY:
            code = await _kill(proc)
            raise _WorkerEnded(f"the CEL worker did not start (status {code})")
        self._proc = proc
        return proc


def _unevaluated(selector: Selector, envs: list[DeviceEnv]) -> list[tuple[Any, list[DeviceEnv]]]:
    """The devices without a result for `selector`, grouped by what one evaluation answers for."""
    groups: dict[Any, tuple[Any, list[DeviceEnv]]] = {}
    for env in envs:
        key = env.shared_key(selector)
        if env.known(selector, key) is not None:
            continue
        if env.error:
            env.remember(selector, None, CelError(selector.expression, env.error))
            continue
        group = groups.get(id(env) if key is None else key)
        if group is None:
            groups[id(env) if key is None else key] = (key, [env])
        else:
            group[1].append(env)
    return list(groups.values())


async def _kill(proc: asyncio.subprocess.Process) -> int:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    return await proc.wait()
