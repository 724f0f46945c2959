"""This process's health, served beside its metrics on its one HTTP port (`--metrics-port`).

Owns that endpoint: `/metrics` (Prometheus text, or OpenMetrics when the scraper asks for it, as
prometheus_client's exposition does), `/healthz` (liveness), `/readyz` (readiness) and 404 for
every other path; the watchdog that ticks on the service's event loop; and the registry of named
readiness checks that each service adds for what it must have before it is useful.

The endpoint runs on its own thread, so it still answers when the event loop is wedged, and then
says so: `/healthz` is 503 naming the stall once the loop has not ticked for
`--health-stall-seconds`. Readiness checks are plain functions evaluated on the loop at each tick
(so they may read loop state freely); `/readyz` serves the last result, and is 503 while the loop
stalls or before it first ticks.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

from shared.logs import get_logger

log = get_logger(__name__)

PATHS = ("/metrics", "/healthz", "/readyz")
LIVENESS_PATH, READINESS_PATH = "/healthz", "/readyz"
DEFAULT_STALL_SECONDS = 10.0
DEFAULT_TICK_SECONDS = 1.0


class Health:
    """Liveness (the loop ticks) and readiness (every registered check passes) of one process."""

    def __init__(
        self,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
        tick_seconds: float = DEFAULT_TICK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self.stall_seconds = stall_seconds
        self.tick_seconds = tick_seconds
        self._since = clock()
        self._last_tick: float | None = None
        self._checks: list[tuple[str, Callable[[], bool]]] = []
        self._not_ready: tuple[str, ...] = ("the event loop has not ticked yet",)

    def configure(self, stall_seconds: float, tick_seconds: float = DEFAULT_TICK_SECONDS) -> None:
        """Set the bounds (at process start); the stall clock starts again from now."""
        if not 0 < tick_seconds < stall_seconds:
            raise ValueError(
                f"the watchdog tick ({tick_seconds} s) must be positive and shorter than the stall "
                f"bound ({stall_seconds} s)"
            )
        self.stall_seconds = stall_seconds
        self.tick_seconds = tick_seconds
        self._since = self._clock()

    # -- readiness registry (called on the loop) --

    def add_check(self, name: str, ready: Callable[[], bool]) -> Callable[[], None]:
        """Register `ready` (True when `name` holds); returns the function that removes it again."""
        entry = (name, ready)
        self._checks.append(entry)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._checks.remove(entry)

        return remove

    @contextlib.contextmanager
    def check(self, name: str, ready: Callable[[], bool]) -> Iterator[None]:
        """`add_check` for the lifetime of a `with` block (a service registers while it runs)."""
        remove = self.add_check(name, ready)
        try:
            yield
        finally:
            remove()

    def _evaluate(self) -> tuple[str, ...]:
        failing: list[str] = []
        for name, ready in list(self._checks):
            try:
                if not ready():
                    failing.append(name)
            except Exception as exc:  # noqa: BLE001 - a broken check reads as not ready, with why
                failing.append(f"{name} (check failed: {type(exc).__name__}: {exc})")
        return tuple(failing)

    # -- the watchdog (on the loop) --

    def tick(self) -> None:
        """One watchdog beat: the loop is alive, and readiness is evaluated afresh."""
        now = self._clock()
        if self._last_tick is not None and now - self._last_tick > self.stall_seconds:
            log.warning(
                "the event loop was stalled", seconds=round(now - self._last_tick, 1), bound_s=self.stall_seconds
            )
        self._not_ready = self._evaluate()
        self._last_tick = now

    async def watchdog(self) -> None:
        """Tick every `tick_seconds` until cancelled; run it as a task on the service's loop."""
        while True:
            self.tick()
            await asyncio.sleep(self.tick_seconds)

    # -- answers (any thread) --

    def stalled(self) -> str | None:
        """Why the process is not alive (the loop stopped ticking), or None when it is."""
        now = self._clock()
        last = self._last_tick
        if last is None:
            waited = now - self._since
            if waited > self.stall_seconds:
                return f"the event loop has not ticked since start {waited:.1f} s ago (bound {self.stall_seconds:g} s)"
            return None
        if now - last > self.stall_seconds:
            return f"the event loop has not ticked for {now - last:.1f} s (bound {self.stall_seconds:g} s)"
        return None

    def not_ready(self) -> list[str]:
        """What keeps the process from being ready: a stall, or the checks that failed at the last tick."""
        stall = self.stalled()
        if stall is not None:
            return [stall]
        if self._last_tick is None:
            return ["the event loop has not ticked yet"]
        return list(self._not_ready)


HEALTH = Health()
"""The process's one Health: `run_until_stopped` runs its watchdog; services add readiness checks to it."""


def _handler(health: Health, registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            url = urlsplit(self.path)
            if url.path == "/metrics":
                self._metrics(parse_qs(url.query))
            elif url.path == LIVENESS_PATH:
                stall = health.stalled()
                self._text(503 if stall else 200, f"not alive: {stall}\n" if stall else "ok\n")
            elif url.path == READINESS_PATH:
                missing = health.not_ready()
                self._text(503 if missing else 200, "not ready: " + "; ".join(missing) + "\n" if missing else "ok\n")
            else:
                self._text(404, f"no such path {url.path}: this endpoint serves {', '.join(PATHS)}\n")

        def _metrics(self, params: dict[str, list[str]]) -> None:
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            source = registry.restricted_registry(params["name[]"]) if "name[]" in params else registry
            body = encoder(source)
            headers = [("Content-Type", content_type)]
            if gzip_accepted(self.headers.get("Accept-Encoding", "")):
                body = gzip.compress(body)
                headers.append(("Content-Encoding", "gzip"))
            self._send(200, headers, body)

        def _text(self, status: int, text: str) -> None:
            self._send(status, [("Content-Type", "text/plain; charset=utf-8")], text.encode())

        def _send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
            """Probes and scrapes every few seconds are not worth a log line."""

    return Handler


class HealthServer:
    """The HTTP endpoint on its own daemon thread; `port` is the bound port, `close()` stops it."""

    def __init__(self, port: int, host: str, health: Health, registry: CollectorRegistry) -> None:
        self._server = ThreadingHTTPServer((host, port), _handler(health, registry))
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="health-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(
    port: int,
    host: str = "0.0.0.0",  # noqa: S104 - probed and scraped from outside the pod
    health: Health = HEALTH,
    registry: CollectorRegistry = REGISTRY,
) -> HealthServer:
    """Serve /metrics, /healthz and /readyz on `host:port` (0 picks a free port)."""
    try:
        server = HealthServer(port, host, health, registry)
    except OSError as exc:
        raise OSError(
            f"cannot serve metrics and health on {host}:{port}: {exc}; choose another --metrics-port"
        ) from exc
    log.info("metrics and health endpoint up", port=server.port, paths="/metrics /healthz /readyz")
    return server
