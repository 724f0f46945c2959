"""The process around `gpu-dra up` and `gpu-dra demo`: their flags turned into a config, logging and the metrics
endpoint set up, and the run under SIGINT/SIGTERM, whose teardown a second signal cannot cut short."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from embedded.cluster.clusterconfig import ClusterConfig
from embedded.cluster.processes import ProcessFailed
from shared.config import load_config_or_report
from shared.health import HEALTH, serve
from shared.logs import setup_logging
from shared.runtime import export_build_info
from shared.tasks import cancel_and_wait

C = TypeVar("C", bound=ClusterConfig)


def cluster_main(
    config_type: type[C], argv: list[str] | None, *, prog: str, description: str, run: Callable[[C], Awaitable[int]]
) -> int:
    """`gpu-dra up` and `gpu-dra demo`: flags -> config (exit 2 naming a bad setting), quiet logs, the
    metrics endpoint (`--metrics-port`), `run(cfg)`; a service that cannot be kept running (it refuses
    its settings) is exit 1, Ctrl-C during start or teardown 130 (SIGTERM 143)."""
    cfg = load_config_or_report(config_type, argv, prog=prog, description=description)
    if cfg is None:
        return 2
    service = prog.replace(" ", "-")
    setup_logging(service, "warning" if cfg.log_level == "info" else cfg.log_level, cfg.log_format)
    if cfg.metrics_port > 0:
        export_build_info(service)
        serve(cfg.metrics_port)  # the restart counts and which services run (processes.RESTARTS, RUNNING)
    try:
        return asyncio.run(until_signalled(run(cfg), prog))
    except ProcessFailed as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


async def until_signalled(main: Awaitable[int], prog: str) -> int:
    """`await main`; SIGINT or SIGTERM cancels it (its teardown then runs to the end: LocalCluster
    stops with finish_even_if_cancelled, so a second signal cannot cut it short) and the exit status is
    128 + the signal. `main` may take the signals over (stop_event) once it handles them itself."""
    task = asyncio.ensure_future(main)
    loop = asyncio.get_running_loop()
    got: list[signal.Signals] = []
    watchdog = asyncio.create_task(HEALTH.watchdog(), name="health-watchdog")  # /healthz, /readyz

    def on_signal(sig: signal.Signals) -> None:
        if got:
            print(f"{prog}: still stopping (waiting for every process to end)", file=sys.stderr, flush=True)
        else:
            print(f"{prog}: {sig.name}: stopping", file=sys.stderr, flush=True)
            task.cancel()
        got.append(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await task
    except asyncio.CancelledError:
        if not got:
            raise
        return 128 + int(got[0])
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await cancel_and_wait([watchdog])
