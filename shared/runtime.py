"""Service start-up and shutdown shared by every service: logs, traces, metrics, NATS, signals.

`run_service` gives the service a connected, provisioned Bus (starting an embedded nats-server
when no URL is configured) and runs its main coroutine until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from shared.bus import Bus
from shared.config import CommonConfig, load_config_or_report
from shared.logs import get_logger, setup_logging
from shared.metrics import start_metrics
from shared.natsserver import EmbeddedNats
from shared.telemetry import setup_telemetry, shutdown_telemetry

log = get_logger(__name__)
C = TypeVar("C", bound=CommonConfig)


@contextlib.asynccontextmanager
async def connected_bus(config: CommonConfig, client_name: str) -> AsyncIterator[Bus]:
    """A provisioned Bus on the configured NATS, or on an embedded server when none is set."""
    embedded: EmbeddedNats | None = None
    url = config.nats_url
    if not url:
        embedded = EmbeddedNats()
        await embedded.start()
        url = embedded.url
        log.info("no NATS URL configured; started embedded nats-server", url=url)
    bus = await Bus.connect(
        url, name=client_name, user=config.nats_user or None, password=config.nats_password or None,
        replicas=config.nats_replicas,
    )
    try:
        await bus.provision()
        yield bus
    finally:
        await bus.close()
        if embedded is not None:
            await embedded.close()


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    return stopping


def prepare_process(config: CommonConfig, service: str) -> None:
    """Logs, traces and metrics for this process."""
    setup_logging(service, config.log_level, config.log_format)
    setup_telemetry(service, config.otel_exporter)
    start_metrics(config.metrics_port)


async def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stopping)`; a signal sets `stopping`, and main is expected to return soon after."""
    stopping = stop_event()
    try:
        await main(stopping)
    finally:
        shutdown_telemetry()


def service_main(
    config_type: type[C],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    service: Callable[[C], str],
    run: Callable[[C, asyncio.Event], Awaitable[None]],
) -> int:
    """A service's `main`: flags and `GPU_DRA_*` -> config (exit 2 naming a bad setting), logs,
    traces and metrics for `service(cfg)`, then `run(cfg, stopping)` until SIGINT/SIGTERM (exit 0)."""
    cfg = load_config_or_report(config_type, argv, prog=prog, description=description)
    if cfg is None:
        return 2
    prepare_process(cfg, service(cfg))
    asyncio.run(run_until_stopped(lambda stopping: run(cfg, stopping)))
    return 0
