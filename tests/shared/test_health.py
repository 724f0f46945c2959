"""shared.health over real HTTP: /metrics as prometheus_client writes it, /healthz failing while the event
loop is wedged (and recovering after), /readyz following the registered checks, 404 elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from shared.health import Health, HealthServer, serve


def get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, str]]:
    """A blocking GET (run it on a thread): status, body, headers."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            raw = resp.read()
            if resp.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            return resp.status, raw.decode(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), dict(err.headers)


@contextlib.asynccontextmanager
async def endpoint(health: Health, registry: CollectorRegistry | None = None) -> AsyncIterator[HealthServer]:
    """The endpoint on a free port, with the watchdog ticking on this test's loop."""
    server = serve(0, host="127.0.0.1", health=health, registry=registry or CollectorRegistry())
    watchdog = asyncio.create_task(health.watchdog())
    try:
        yield server
    finally:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
        server.close()


async def test_metrics_are_prometheus_text_or_openmetrics_and_other_paths_are_404() -> None:
    registry = CollectorRegistry()
    Counter("gpu_dra_test_things", "things counted", registry=registry).inc(3)
    async with endpoint(Health(), registry) as server:
        status, text, headers = await asyncio.to_thread(get, server.port, "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert "gpu_dra_test_things_total 3.0" in text
        status, text, headers = await asyncio.to_thread(
            get,
            server.port,
            "/metrics",
            {"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"},
        )
        assert status == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
        assert headers["Content-Encoding"] == "gzip" and text.rstrip().endswith("# EOF")
        status, text, _ = await asyncio.to_thread(get, server.port, "/metrics?name[]=nothing_here")
        assert status == 200 and "gpu_dra_test_things" not in text
        for path in ("/", "/foo", "/metricsx", "/healthz/extra"):
            status, text, _ = await asyncio.to_thread(get, server.port, path)
            assert status == 404 and "serves /metrics, /healthz, /readyz" in text, path


async def test_readyz_lists_failing_checks_and_follows_them() -> None:
    health = Health(stall_seconds=5, tick_seconds=0.05)
    connected = asyncio.Event()
    async with endpoint(health) as server:
        remove = health.add_check("connected to NATS", connected.is_set)
        with (
            health.check("first scan done", lambda: True),
            health.check("broken", lambda: 1 / 0 == 0),
        ):  # a check that raises reads as not ready
            # One beat on this loop now: the watchdog task may not have run its first tick before the HTTP
            # thread answers, and a tick that ran before add_check has not seen these checks yet.
            health.tick()

            async def readyz() -> tuple[int, str]:
                status, text, _ = await asyncio.to_thread(get, server.port, "/readyz")
                return status, text

            status, text = await readyz()
            assert status == 503 and "connected to NATS" in text and "ZeroDivisionError" in text
            assert "first scan done" not in text
            assert (await asyncio.to_thread(get, server.port, "/healthz"))[0] == 200
        connected.set()
        async with asyncio.timeout(5):  # the next tick re-evaluates
            while (await readyz())[0] != 200:
                await asyncio.sleep(0.02)
        remove()
        assert health.not_ready() == []


async def test_healthz_fails_while_the_loop_is_wedged_and_recovers_after() -> None:
    """The HTTP thread lives on while a callback blocks the loop: /healthz must say 503 anyway."""
    health = Health(stall_seconds=0.5, tick_seconds=0.05)
    async with endpoint(health) as server:
        assert (await asyncio.to_thread(get, server.port, "/healthz"))[0] == 200
        release = threading.Event()
        seen: dict[str, tuple[int, str]] = {}

        def probe_while_wedged() -> None:
            deadline = time.monotonic() + 10
            try:
                while time.monotonic() < deadline:
                    status, text, _ = get(server.port, "/healthz")
                    if status == 503:
                        seen["healthz"] = (status, text)
                        seen["readyz"] = get(server.port, "/readyz")[:2]
                        seen["metrics"] = get(server.port, "/metrics")[:2]
                        return
                    time.sleep(0.05)  # polling another thread's effect: the loop is blocked
            finally:
                release.set()

        prober = threading.Thread(target=probe_while_wedged)
        wedged_at = time.monotonic()
        prober.start()
        # block the loop itself until the prober has seen the stall (or given up)
        asyncio.get_running_loop().call_soon(release.wait, 15)
        await asyncio.sleep(0)
        await asyncio.to_thread(prober.join, 15)
        assert "healthz" in seen, "/healthz never failed while the loop was blocked"
        status, text = seen["healthz"]
        assert status == 503 and "event loop has not ticked for" in text and "bound 0.5 s" in text
        assert time.monotonic() - wedged_at < 5
        assert seen["readyz"][0] == 503 and "event loop has not ticked" in seen["readyz"][1]
        assert seen["metrics"][0] == 200, "metrics stay served during a stall"
        async with asyncio.timeout(5):  # the loop runs again: the next tick makes it alive
            while (await asyncio.to_thread(get, server.port, "/healthz"))[0] != 200:
                await asyncio.sleep(0.05)


def test_a_loop_that_never_started_fails_liveness_after_the_bound() -> None:
    now = [100.0]
    health = Health(clock=lambda: now[0])
    health.configure(stall_seconds=2)
    assert health.stalled() is None and health.not_ready() == ["the event loop has not ticked yet"]
    now[0] += 2.5
    assert "has not ticked since start 2.5 s ago" in (health.stalled() or "")
    health.tick()
    assert health.stalled() is None and health.not_ready() == []


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="shorter than the stall bound"):
        Health().configure(stall_seconds=1, tick_seconds=1)


def test_a_port_in_use_is_a_clear_error() -> None:
    first = serve(0, host="127.0.0.1", registry=CollectorRegistry())
    try:
        with pytest.raises(OSError, match="choose another --metrics-port"):
            serve(first.port, host="127.0.0.1", registry=CollectorRegistry())
    finally:
        first.close()
