"""`gpu-dra preparer`: flags -> typed config -> run the kubelet plugins until SIGINT/SIGTERM.

Owns process wiring only: one PreparerService per driver in `--drivers` (each on its own sockets),
the Kubernetes client they share (kubeconfig or in-cluster), the one NATS connection in the
background that every service gets once it answers (an embedded nats-server when no URL is set),
the Kubernetes Event for a quarantined checkpoint, readiness (each driver registered with the
kubelet) and the gRPC health service on `--healthcheck-port`, and exit codes (0 ok, 2 bad settings,
including a --driver-root that holds no usable driver, 1 failed to start).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.preparer.config import DESCRIPTION, PreparerConfig, parse
from services.preparer.host.claims import KubeClaimSource
from services.preparer.host.healthcheck import HealthCheck, HealthCheckServer
from services.preparer.host.service import PreparerService
from services.preparer.host.sockets import SocketError
from services.preparer.nodesettings import KubeNodeSettings
from shared import nodeconfig
from shared.bus import Bus, LoginRefused
from shared.driverroot import DriverRootError
from shared.health import HEALTH
from shared.heap import one_malloc_arena, trim_periodically
from shared.kube.client import KubeConfigError, kube_api_client
from shared.kube.events import event_body, record_event
from shared.logs import get_logger
from shared.runtime import connect_configured, nats_url_or_embedded, service_main
from shared.tasks import cancel_and_wait

log = get_logger(__name__)
# API connections at once: a prepare reads each of its claims, one GET each. Each open connection holds
# ~0.35 MB (asyncio's TLS read buffer, OpenSSL's state); kubernetes-asyncio's 100 would open one per
# concurrent call. aiohttp's pool reuses its idle connections in turn, so those a burst opened stay open
# while any load goes on: this bound is what they cost at most (~1.4 MB)
API_CONNECTIONS = 4
LOGIN_RETRY_S = 30.0  # between tries while NATS refuses the credentials (it will until they change)
# how often freed C heap goes back to the kernel (shared.heap): RSS follows a burst down within this
HEAP_TRIM_S = 10.0
# worker threads for file work (checkpoint writes with their fsync, CDI and inventory files, one writer
# per checkpoint at a time): asyncio's default is min(32, cores + 4), 32 threads on a GPU node, each
# with its own stack and glibc malloc arena
FILE_THREADS = 4


def corrupt_checkpoint_reporter(api_client: Any, node: str, driver: str) -> Any:
    async def report(reason: str, moved_to: Path) -> None:
        body = event_body(
            {"apiVersion": "v1", "kind": "Node", "name": node},
            reason="CheckpointCorrupt",
            type="Warning",
            component="gpu-dra-preparer",
            instance=node,
            message=f"{driver} checkpoint was corrupt ({reason[:300]}); moved to {moved_to} and started empty",
        )
        await record_event(api_client, body)

    return report


async def connect_bus_forever(cfg: PreparerConfig, services: list[PreparerService], stopping: asyncio.Event) -> None:
    """Attach a bus to the services as soon as NATS answers; keep trying until stopped."""
    async with nats_url_or_embedded(cfg) as url:
        bus: Bus | None = None
        try:
            while bus is None and not stopping.is_set():
                try:
                    bus = await connect_configured(cfg, url, f"preparer-{cfg.node}", initial_attempts=3)
                except LoginRefused as exc:  # the creds file is read again at each try: a fixed Secret heals it
                    log.error(
                        "NATS refused this preparer's credentials; plain GPU prepares still work, events and "
                        "ComputeDomain channels do not",
                        error=str(exc),
                    )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), timeout=LOGIN_RETRY_S)
                except Exception as exc:  # noqa: BLE001 - keep serving the plain path, try again
                    log.warning("NATS not reachable yet; plain GPU prepares still work", error=str(exc))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), timeout=2.0)
            if bus is None:
                return
            try:
                await bus.provision()
            except Exception as exc:  # noqa: BLE001 - another service may own the streams
                log.info("stream/bucket provisioning skipped", error=str(exc))
            for service in services:
                service.attach_bus(bus)
            await stopping.wait()
        finally:
            if bus is not None:
                await bus.close()


async def _run(cfg: PreparerConfig, stopping: asyncio.Event) -> int:
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=FILE_THREADS, thread_name_prefix="preparer-files")
    )
    api_client = await kube_api_client(cfg.kubeconfig, max_connections=API_CONNECTIONS)
    claims = KubeClaimSource(api_client)
    settings = KubeNodeSettings(
        api_client, cfg.node, file_config=nodeconfig.load(cfg.node_config) if cfg.node_config else None
    )
    services = [
        PreparerService(
            cfg,
            claims,
            driver=driver,
            report_corrupt=corrupt_checkpoint_reporter(api_client, cfg.node, driver),
            settings=settings,
        )
        for driver in cfg.drivers
    ]
    started: list[PreparerService] = []
    health_server = HealthCheckServer(HealthCheck(services), cfg.healthcheck_port) if cfg.healthcheck_port else None
    with contextlib.ExitStack() as readiness:
        for service in services:
            readiness.enter_context(
                HEALTH.check(f"{service.driver} registered with the kubelet", service.registration.registered.is_set)
            )
        try:
            for service in services:
                await service.start()
                started.append(service)
            if health_server is not None:
                await health_server.start()
        except (SocketError, OSError, DriverRootError) as exc:
            for service in reversed(started):
                await service.stop()
            await api_client.close()
            print(f"gpu-dra preparer: error: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, DriverRootError) else 1  # a --driver-root without a driver: bad settings
        bus_task = asyncio.create_task(connect_bus_forever(cfg, services, stopping))
        trim_task = asyncio.create_task(trim_periodically(HEAP_TRIM_S), name="heap-trim")  # first: start-up's garbage
        settings_task = asyncio.create_task(settings.run(stopping), name="node-settings")
        try:
            await stopping.wait()
        finally:
            await cancel_and_wait([trim_task, settings_task])
            if health_server is not None:
                await health_server.stop()
            for service in reversed(services):
                await service.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await bus_task
            await api_client.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    # before any thread starts: gRPC's and the file writers' allocations in the main arena (shared.heap)
    one_malloc_arena()
    return service_main(
        PreparerConfig,
        argv,
        prog="gpu-dra preparer",
        description=DESCRIPTION,
        parse=parse,
        service=lambda cfg: f"preparer-{cfg.node}",
        run=_run,
        failures=((KubeConfigError, 2),),
    )


if __name__ == "__main__":
    raise SystemExit(main())
