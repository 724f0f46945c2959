"""The run's watchdog ends a run whose failed test then hangs in teardown, and says why; under pytest-xdist, with
the flags `make test` runs the suite with, it ends that worker, and the run ends and fails with the same report."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def make_unit_xdist_flags() -> list[str]:
    """The pytest-xdist flags of `make unit` (from `-n` on)."""
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if "-m pytest" in x and " -n " in x)
    args = line.split()
    return args[args.index("-n") :]


HANGING = """
import asyncio
import pytest

async def stubborn():
    while True:  # swallows cancellation, as a library flushing a socket may
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass

@pytest.fixture
async def leaked():
    asyncio.get_running_loop().create_task(stubborn(), name="stubborn-task")
    yield

async def test_fails_then_hangs_in_teardown(leaked):
    assert 1 == 2, "the failure the watchdog must still show"
"""


@pytest.mark.parametrize("workers", [[], make_unit_xdist_flags()], ids=["one-process", "xdist"])
async def test_a_failed_test_hanging_in_teardown_ends_the_run_with_its_failure_and_task_stacks(
    tmp_path: Path, workers: list[str]
) -> None:
    # a test after the hanging one in its file, and another file
    (tmp_path / "test_hang.py").write_text(HANGING + "\n\ndef test_beside():\n    pass\n")
    (tmp_path / "test_other.py").write_text("def test_elsewhere():\n    pass\n")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.watchdog",
        "-c",
        str(tmp_path / "pytest.ini"),
        "--rootdir",
        str(tmp_path),
        "-o",
        "timeout=60",
        *workers,
        str(tmp_path / "test_hang.py"),
        str(tmp_path / "test_other.py"),
        cwd=ROOT,
        env={**os.environ, "GPU_DRA_TEST_WATCHDOG_S": "3", "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"the run did not end within 60 s ({' '.join(workers) or 'one process'})") from None
    text = out.decode()
    if workers:  # the worker ends, and so does the run: it fails
        assert proc.returncode == 1, text
        assert re.search(r"worker 'gw\d' crashed while running 'test_hang.py::test_fails_then_hangs_in_teardown'", text)
    else:
        assert proc.returncode == 3, text
    # once: a replaced worker ran the file again, and its hang again, until xdist's 8 restarts were spent (with
    # the suite's 180 s watchdog, 27 minutes)
    assert text.count("test_fails_then_hangs_in_teardown still running after 3s") == 1, text
    assert "the failure the watchdog must still show" in text
    assert "stubborn-task" in text and "in stubborn" in text
