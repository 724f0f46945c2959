"""One kubelet plugin's wiring and lifetime: sockets up, checkpoint recovered, bus attached when it is there.

Owns, for one driver on one node, what every driver has: `<registry>/<driver>-reg.sock`,
`<plugins>/<driver>/dra.sock`, `<plugins>/<driver>/checkpoint.json` and `<plugins>/<driver>/outbox.jsonl`
(the lifecycle events not yet in JetStream; what a previous process left is sent), the event sender,
the start order (checkpoint first, the driver's start work, DRA socket before the registration
socket), stale-claim cleanup every `cleanup_interval`, the driver's background work once a bus is
attached, and clean shutdown (sockets removed). What differs per driver comes from its
`plugin.DriverPlugin` (`gpu/plugin.py`, `channel/driver.py`). `gpu-dra preparer` runs one of these per driver.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from services.preparer.config import PreparerConfig
from services.preparer.host import sockets
from services.preparer.host.checkpoint import Checkpoint, read_boot_id
from services.preparer.host.claims import ClaimSource
from services.preparer.host.lifecycle import LifecycleEvents
from services.preparer.host.plugin import DriverPlugin, PluginContext
from services.preparer.host.registration import Registration, add_registration_service
from services.preparer.host.server import DraCore, add_dra_services
from services.preparer.nodesettings import NodeSettings
from shared.bus import Bus
from shared.deviceclasses import CD_DRIVER, GPU_DRIVER
from shared.logs import get_logger
from shared.tasks import cancel_and_wait

log = get_logger(__name__)


def build(ctx: PluginContext) -> DriverPlugin:
    """The plugin of `ctx.driver` (its modules are loaded by the process that serves it)."""
    if ctx.driver == GPU_DRIVER:
        from services.preparer.gpu.plugin import GpuPlugin

        return GpuPlugin(ctx)
    if ctx.driver == CD_DRIVER:
        from services.preparer.channel.driver import ChannelPlugin

        return ChannelPlugin(ctx)
    raise ValueError(f"no kubelet plugin for driver {ctx.driver!r}; known: {GPU_DRIVER}, {CD_DRIVER}")


class PreparerService:
    """One running kubelet plugin for one driver on one node."""

    def __init__(
        self,
        cfg: PreparerConfig,
        claims: ClaimSource,
        *,
        driver: str = GPU_DRIVER,
        report_corrupt: Callable[[str, Path], Awaitable[None]] | None = None,
        settings: NodeSettings | None = None,
    ) -> None:
        self.cfg = cfg
        self.driver = driver
        self.plugin_dir = Path(cfg.plugins_dir) / driver
        self.dra_socket = self.plugin_dir / "dra.sock"
        self.registration_socket = Path(cfg.registry_dir) / f"{driver}-reg.sock"
        self.checkpoint = Checkpoint(self.plugin_dir / "checkpoint.json", boot_id=read_boot_id(cfg.boot_id_path))
        self.report_corrupt = report_corrupt
        self.events = LifecycleEvents(
            cfg.node,
            driver,
            self.plugin_dir / "outbox.jsonl",
            max_events=cfg.outbox_max_events,
            max_bytes=cfg.outbox_max_bytes,
        )
        self.checkpoint.journal = self.events.outbox
        self.plugin = build(
            PluginContext(
                cfg=cfg,
                driver=driver,
                claims=claims,
                plugin_dir=self.plugin_dir,
                checkpoint=self.checkpoint,
                events=self.events,
                settings=settings or NodeSettings(),
            )
        )
        self.preparer = self.plugin.preparer
        self.registration = Registration(driver, str(self.dra_socket))
        self.bus: Bus | None = None
        self.bus_attached = asyncio.Event()
        self._dra_server: grpc.aio.Server | None = None
        self._reg_server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        sockets.check_path(self.dra_socket)
        sockets.check_path(self.registration_socket)
        await self.checkpoint.load()
        await self.events.outbox.load()
        # a preparation whose events reached the outbox but whose checkpoint write did not keeps its number
        self.checkpoint.preparation_seq = max(self.checkpoint.preparation_seq, self.events.outbox.max_preparation)
        if self.checkpoint.quarantined is not None and self.report_corrupt is not None:
            try:
                await self.report_corrupt(self.checkpoint.corrupt_reason, self.checkpoint.quarantined)
            except Exception as exc:  # noqa: BLE001 - reporting must not stop start-up
                log.warning("could not report the corrupt checkpoint as a Kubernetes Event", error=str(exc))
        self._tasks.append(asyncio.create_task(self.events.run(), name=f"lifecycle-events-{self.driver}"))
        await self.plugin.start()
        self._dra_server = grpc.aio.server()
        add_dra_services(self._dra_server, DraCore(self.preparer, self.driver))
        self.plugin.add_services(self._dra_server)
        await sockets.serve_on(self._dra_server, self.dra_socket)
        self._reg_server = grpc.aio.server()
        add_registration_service(self._reg_server, self.registration)
        await sockets.serve_on(self._reg_server, self.registration_socket)
        self._tasks.append(asyncio.create_task(self._cleanup_loop(), name=f"stale-claim-cleanup-{self.driver}"))
        self._tasks.append(
            asyncio.create_task(self.preparer.retry_failed_rollbacks(), name=f"rollback-retry-{self.driver}")
        )
        log.info(
            "preparer serving",
            driver=self.driver,
            node=self.cfg.node,
            dra_socket=str(self.dra_socket),
            registration_socket=str(self.registration_socket),
            claims=len(self.checkpoint.claims),
        )

    def attach_bus(self, bus: Bus) -> None:
        """Use `bus` for lifecycle events and the driver's NATS work from now on."""
        self.bus = bus
        self.events.attach(bus)
        for name, work in self.plugin.attach_bus(bus).items():
            self._tasks.append(asyncio.create_task(work, name=f"{name}-{self.driver}"))
        self.bus_attached.set()

    async def _cleanup_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.cleanup_interval)
            try:
                await self.preparer.recover(only_failed=True)
                await self.preparer.cleanup_stale()
            except Exception as exc:  # noqa: BLE001 - next round
                log.warning("stale-claim cleanup failed", driver=self.driver, error=str(exc))

    async def stop(self) -> None:
        for server, path in ((self._reg_server, self.registration_socket), (self._dra_server, self.dra_socket)):
            if server is not None:
                await server.stop(grace=1.0)
                sockets.remove(path)
        await cancel_and_wait(self._tasks)
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
        self._tasks.clear()

    async def __aenter__(self) -> PreparerService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
