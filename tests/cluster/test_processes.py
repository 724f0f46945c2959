"""The local cluster's Supervisor (embedded/cluster/processes.py) with real child processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from embedded.cluster.processes import ProcessFailed, Supervisor
from shared.backoff import Backoff
from tests.polling import gone

SLEEPER = [sys.executable, "-c", "import time; time.sleep(3600)"]


def quick() -> Backoff:
    return Backoff(initial_s=0.05, cap_s=0.2)


async def _reported(lines: list[str], changed: asyncio.Event, *texts: str, timeout: float = 20) -> str:
    """The first reported line that has every one of `texts`, as soon as it is reported."""
    async with asyncio.timeout(timeout):
        while True:
            for line in lines:
                if all(text in line for text in texts):
                    return line
            changed.clear()
            await changed.wait()


@pytest.fixture
async def supervisor(tmp_path: Path):
    lines: list[str] = []
    changed = asyncio.Event()

    def report(line: str) -> None:
        lines.append(line)
        changed.set()

    sup = Supervisor(tmp_path / "logs", report=report, backoff=quick)
    sup.lines, sup.changed = lines, changed  # type: ignore[attr-defined]
    try:
        yield sup
    finally:
        await sup.stop(grace=2)


async def test_a_child_killed_is_restarted_and_counted_the_others_untouched(supervisor: Supervisor) -> None:
    victim = await supervisor.start("victim", SLEEPER)
    bystander = await supervisor.start("bystander", SLEEPER)
    first, other = victim.pid, bystander.pid
    os.kill(first, signal.SIGKILL)
    line = await _reported(supervisor.lines, supervisor.changed, "victim restarted")  # type: ignore[attr-defined]
    assert victim.restarts == 1 and victim.pid != first and victim.last_exit == -signal.SIGKILL, line
    assert bystander.pid == other and bystander.restarts == 0
    assert any("killed by SIGKILL" in x for x in supervisor.lines)  # type: ignore[attr-defined]
    os.kill(victim.pid, signal.SIGKILL)  # and again: the count goes on
    await _reported(supervisor.lines, supervisor.changed, "restarted", "restart 2)")  # type: ignore[attr-defined]
    assert victim.restarts == 2


async def test_a_child_that_refuses_its_settings_is_not_restarted_and_fails_the_wait(supervisor: Supervisor) -> None:
    await supervisor.start("bad", [sys.executable, "-c", "import sys; print('--nodes: not a number'); sys.exit(2)"])

    async def never() -> bool:
        return False

    with pytest.raises(ProcessFailed, match=r"bad exit status 2 while waiting for Godot(.|\n)*not a number"):
        await supervisor.wait_until("Godot", never, timeout=20)
    assert supervisor.child("bad").restarts == 0


async def test_a_wait_that_times_out_names_the_child_that_kept_exiting(supervisor: Supervisor) -> None:
    await supervisor.start("crashy", [sys.executable, "-c", "print('boom'); raise SystemExit(1)"])
    await _reported(supervisor.lines, supervisor.changed, "restart 2)")  # type: ignore[attr-defined]

    async def never() -> bool:
        return False

    with pytest.raises(
        ProcessFailed, match=r"timed out(.|\n)*crashy exited \d+ time\(s\), last exit status 1(.|\n)*boom"
    ):
        await supervisor.wait_until("Godot", never, timeout=0.5)


async def test_stop_ends_every_child_and_its_group_and_restarts_nothing(supervisor: Supervisor) -> None:
    spawner = await supervisor.start(
        "spawner",
        [
            sys.executable,
            "-c",
            (
                "import subprocess, sys, time; "
                "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)']);"
                "print(p.pid, flush=True); time.sleep(3600)"
            ),
        ],
    )
    child = await supervisor.start("plain", SLEEPER)
    log = spawner.log_path
    async with asyncio.timeout(20):
        while not log.read_text().strip():
            await asyncio.sleep(0.02)  # no event for a line in a file
    grandchild = int(log.read_text().split()[0])
    pids = [spawner.pid, child.pid, grandchild]
    await supervisor.stop(grace=2)
    assert await asyncio.to_thread(gone, pids, 10) == []
    assert not any("restart" in x for x in supervisor.lines)  # type: ignore[attr-defined]
    with pytest.raises(asyncio.CancelledError):
        await supervisor.start("late", SLEEPER)


async def test_without_restarts_any_exit_fails_the_wait(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs", restart=False)
    try:
        child = await sup.start("once", [sys.executable, "-c", "raise SystemExit(0)"])

        async def never() -> bool:
            return False

        with pytest.raises(ProcessFailed, match="once exit status 0 while waiting for Godot"):
            await sup.wait_until("Godot", never, timeout=20)
        assert child.restarts == 0
    finally:
        await sup.stop(grace=2)
