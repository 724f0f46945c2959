"""Service start-up and shutdown shared by every service: logs, traces, metrics and health, NATS, signals.

`prepare_process` sets up logs, traces and the metrics/health endpoint; `connected_bus` gives the
service a connected, provisioned Bus (starting an embedded nats-server when no URL is configured;
the process is ready only while connected); `run_until_stopped` runs its main coroutine until
SIGINT/SIGTERM, with the health watchdog (shared.health) ticking on its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from prometheus_client import Gauge

from shared import featuregates
from shared.bus import Bus, NatsTLS
from shared.config import CommonConfig, ConfigError, load_config_or_report
from shared.health import HEALTH, serve
from shared.logs import get_logger, setup_logging
from shared.natsserver import EmbeddedNats
from shared.tasks import cancel_and_wait
from shared.telemetry import package_version, setup_telemetry, shutdown_telemetry

log = get_logger(__name__)
C = TypeVar("C", bound=CommonConfig)


def nats_tls(config: CommonConfig) -> NatsTLS:
    """The TLS and credential files a service's settings name (GPU_DRA_NATS_TLS_CA/_CERT/_KEY, _CREDS,
    _TOKEN_FILE)."""
    return NatsTLS(
        ca_file=config.nats_tls_ca,
        cert_file=config.nats_tls_cert,
        key_file=config.nats_tls_key,
        creds_file=config.nats_creds,
        token_file=config.nats_token_file,
    )


@contextlib.asynccontextmanager
async def nats_url_or_embedded(config: CommonConfig) -> AsyncIterator[str]:
    """The configured NATS URL, or that of an embedded nats-server (JetStream on) run for this block."""
    if config.nats_url:
        yield config.nats_url
        return
    embedded = EmbeddedNats()
    await embedded.start()
    log.info("no NATS URL configured; started embedded nats-server", url=embedded.url)
    try:
        yield embedded.url
    finally:
        await embedded.close()


async def connect_configured(config: CommonConfig, url: str, client_name: str, **options: Any) -> Bus:
    """Bus.connect with the configured identity (user, password, creds, token, TLS) and replicas."""
    return await Bus.connect(
        url,
        name=client_name,
        user=config.nats_user or None,
        password=config.nats_password or None,
        replicas=config.nats_replicas,
        tls=nats_tls(config),
        **options,
    )


@contextlib.asynccontextmanager
async def connected_bus(config: CommonConfig, client_name: str) -> AsyncIterator[Bus]:
    """A provisioned Bus on the configured NATS, or on an embedded server when none is set.

    The process is not ready (shared.health) from the moment this is entered until it is connected,
    nor while the connection is lost."""
    buses: list[Bus] = []
    remove_check = HEALTH.add_check("connected to NATS", lambda: any(bus.connected for bus in buses))
    try:
        async with nats_url_or_embedded(config) as url:
            bus = await connect_configured(config, url, client_name)
            try:
                await bus.provision()
                buses.append(bus)
                yield bus
            finally:
                await bus.close()
    finally:
        remove_check()


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    return stopping


BUILD_INFO = Gauge(
    "gpu_dra_build_info",
    "1, labelled with what runs: the service, the package version, Python",
    ["service", "version", "python"],
)


def export_build_info(service: str) -> None:
    """`gpu_dra_build_info{service, version, python} 1`: the version `gpu-dra --version` prints (the package's)."""
    BUILD_INFO.labels(service, package_version(), platform.python_version()).set(1)


def prepare_process(config: CommonConfig, service: str) -> None:
    """Logs, traces, and the metrics and health endpoint (on `--metrics-port`; 0 is off) for this process."""
    export_build_info(service)
    featuregates.export(config.gates)
    setup_logging(service, config.log_level, config.log_format)
    setup_telemetry(
        service, config.otel_exporter, node=str(getattr(config, "node", "") or ""), periodic=config.otel_periodic_ratio
    )
    HEALTH.configure(config.health_stall_seconds)
    if config.metrics_port > 0:
        serve(config.metrics_port)


async def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stopping)` with the health watchdog ticking; a signal sets `stopping`, and main is
    expected to return soon after."""
    stopping = stop_event()
    watchdog = asyncio.create_task(HEALTH.watchdog(), name="health-watchdog")
    try:
        await main(stopping)
    finally:
        await cancel_and_wait([watchdog])
        shutdown_telemetry()


Failures = Sequence[tuple[type[BaseException], int]]


def service_main(
    config_type: type[C],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    service: Callable[[C], str],
    run: Callable[[C, asyncio.Event], Awaitable[int | None]],
    check: Callable[[C], object] | None = None,
    parse: Callable[[list[str]], C] | None = None,
    failures: Failures = (),
) -> int:
    """Every process's `main`: flags and `GPU_DRA_*` -> config (exit 2 naming a bad setting), logs,
    traces, metrics and health for `service(cfg)`, then `run(cfg, stopping)` until SIGINT/SIGTERM.

    `parse(argv)`: the service's own flags -> config (its cross-field checks included; ConfigError is
    exit 2); by default `load_config` of `config_type`, then `check(cfg)`. `run` returns the exit code
    (None: 0). `failures`: (exception type, exit code) pairs: such an error from `check` or `run` ends
    the process with `prog: error: <message>` and that code, for the errors a service documents (the
    API server unreachable, NVML missing, ...); anything else is a crash with its traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if parse is not None:
            cfg = parse(args)
        else:
            loaded = load_config_or_report(config_type, args, prog=prog, description=description)
            if loaded is None:
                return 2
            cfg = loaded
        if check is not None:  # settings that need more than their type (files, keys): before anything starts
            check(cfg)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except tuple(kind for kind, _ in failures) as exc:
        return _failed(prog, exc, failures)
    prepare_process(cfg, service(cfg))
    code: list[int | None] = [None]

    async def main(stopping: asyncio.Event) -> None:
        code[0] = await run(cfg, stopping)

    try:
        asyncio.run(run_until_stopped(main))
    except tuple(kind for kind, _ in failures) as exc:
        return _failed(prog, exc, failures)
    return int(code[0] or 0)


def _failed(prog: str, exc: BaseException, failures: Failures) -> int:
    for kind, exit_code in failures:
        if isinstance(exc, kind):
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return exit_code
    raise exc
