"""A pytest plugin: a last-resort watchdog for the test run. One test (setup, call and teardown) that
outlives GPU_DRA_TEST_WATCHDOG_S (180 s by default, beyond pytest-timeout's 120 s; a test marked with a
longer timeout gets that plus 60 s) ends the run with its failure reports, every thread's stack and
every asyncio task's stack.

pytest-timeout stops its timer as soon as a test fails (its `pytest_exception_interact` hook), so a
teardown that then hangs (a task that will not end when its event loop is closed) would hang CI.

Under xdist the watchdog ends its worker; `make unit` runs with `--max-worker-restart 0`, so that ends the run
with the crash reported, where a replaced worker was given the hanging file again, at each of xdist's restarts.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest


class Watchdog:
    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.failures: list[str] = []
        self._timer: threading.Timer | None = None
        self.capture: Any = None  # pytest's capture manager: suspended so that the report reaches the terminal

    def arm(self, nodeid: str, limit_s: float | None = None) -> None:
        self.failures = []
        limit = max(self.limit_s, limit_s or 0.0)
        self._timer = threading.Timer(limit, self._fire, args=(nodeid, limit))
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def record(self, report: Any) -> None:
        if report.failed:
            self.failures.append(f"--- {report.nodeid} failed in {report.when}:\n{report.longreprtext}")

    def _fire(self, nodeid: str, limit_s: float) -> None:
        if self.capture is not None:
            self.capture.suspend_global_capture(in_=False)
        out = sys.stderr
        out.write(
            f"\n\n*** {nodeid} still running after {limit_s:.0f}s (setup, call and teardown); ending the test run ***\n"
        )
        for failure in self.failures:
            out.write(failure + "\n")
        out.write("\n*** thread stacks ***\n")
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.write("\n*** asyncio tasks ***\n")
        for loop in [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]:
            if loop.is_closed():
                continue
            for task in list(asyncio.all_tasks(loop)):
                out.write(f"{task!r}\n")
                task.print_stack(limit=12, file=out)
        out.flush()
        os._exit(3)


_WATCHDOG = Watchdog(limit_s=float(os.environ.get("GPU_DRA_TEST_WATCHDOG_S", "180")))


def pytest_configure(config: pytest.Config) -> None:
    _WATCHDOG.capture = config.pluginmanager.getplugin("capturemanager")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    marker = item.get_closest_marker("timeout")  # a test allowed longer than pytest-timeout's default
    _WATCHDOG.arm(item.nodeid, float(marker.args[0]) + 60 if marker and marker.args else None)
    try:
        yield
    finally:
        _WATCHDOG.disarm()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _WATCHDOG.record(report)
