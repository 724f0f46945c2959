"""The preparer's wiring and lifetime: sockets up, checkpoint recovered, bus attached when it is there.

Owns the start order (checkpoint and inventory cache first, DRA socket before the registration
socket), the background work (NATS connection with retry, inventory watch, lifecycle sender,
stale-claim cleanup every `cleanup_interval`) and clean shutdown (sockets removed). The plain
full-GPU path never waits for NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from services.preparer import sockets
from services.preparer.cdi import CdiWriter
from services.preparer.checkpoint import Checkpoint, read_boot_id
from services.preparer.claims import ClaimSource
from services.preparer.config import PreparerConfig
from services.preparer.devices import DeviceOps, Inventory
from services.preparer.health import HealthWatch, add_health_service
from services.preparer.lifecycle import LifecycleEvents
from services.preparer.prepare import Preparer
from services.preparer.registration import Registration, add_registration_service
from services.preparer.server import DraCore, add_dra_services
from shared.logs import get_logger

log = get_logger(__name__)


class PreparerService:
    """One running kubelet plugin for one driver on one node."""

    def __init__(self, cfg: PreparerConfig, claims: ClaimSource, *,
                 report_corrupt: Callable[[str, Path], Awaitable[None]] | None = None) -> None:
        self.cfg = cfg
        self.plugin_dir = Path(cfg.plugins_dir) / cfg.driver
        self.dra_socket = self.plugin_dir / "dra.sock"
        self.registration_socket = Path(cfg.registry_dir) / f"{cfg.driver}-reg.sock"
        self.checkpoint = Checkpoint(self.plugin_dir / "checkpoint.json",
                                     boot_id=read_boot_id(cfg.boot_id_path))
        self.report_corrupt = report_corrupt
        self.inventory = Inventory(cfg.node, self.plugin_dir / "inventory-cache.json", dev_root=cfg.dev_root)
        self.ops = DeviceOps(cfg.node, timeout=cfg.device_op_timeout)
        self.events = LifecycleEvents(cfg.node, cfg.driver)
        self.preparer = Preparer(driver=cfg.driver, node=cfg.node, claims=claims, inventory=self.inventory,
                                 ops=self.ops, cdi=CdiWriter(Path(cfg.cdi_dir)), checkpoint=self.checkpoint,
                                 events=self.events)
        self.registration = Registration(cfg.driver, str(self.dra_socket))
        self.health = HealthWatch(cfg.node, self.inventory)
        self.bus: Any = None
        self.bus_attached = asyncio.Event()
        self._dra_server: grpc.aio.Server | None = None
        self._reg_server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        sockets.check_path(self.dra_socket)
        sockets.check_path(self.registration_socket)
        await self.checkpoint.load()
        if self.checkpoint.quarantined is not None and self.report_corrupt is not None:
            try:
                await self.report_corrupt(self.checkpoint.corrupt_reason, self.checkpoint.quarantined)
            except Exception as exc:  # noqa: BLE001 - reporting must not stop start-up
                log.warning("could not report the corrupt checkpoint as a Kubernetes Event", error=str(exc))
        await self.inventory.load_cache()
        self._tasks.append(asyncio.create_task(self.events.run(), name="lifecycle-events"))
        await self.preparer.recover()
        self._dra_server = grpc.aio.server()
        add_dra_services(self._dra_server, DraCore(self.preparer, self.cfg.driver))
        add_health_service(self._dra_server, self.health)
        await sockets.serve_on(self._dra_server, self.dra_socket)
        self._reg_server = grpc.aio.server()
        add_registration_service(self._reg_server, self.registration)
        await sockets.serve_on(self._reg_server, self.registration_socket)
        self._tasks.append(asyncio.create_task(self._cleanup_loop(), name="stale-claim-cleanup"))
        log.info("preparer serving", driver=self.cfg.driver, node=self.cfg.node, dra_socket=str(self.dra_socket),
                 registration_socket=str(self.registration_socket), claims=len(self.checkpoint.claims))

    def attach_bus(self, bus: Any) -> None:
        """Use `bus` for device operations, inventory and lifecycle events from now on."""
        self.bus = bus
        self.ops.bus = bus
        self.events.attach(bus)
        self._tasks.append(asyncio.create_task(self._watch_inventory(bus), name="inventory-watch"))
        self._tasks.append(asyncio.create_task(self.health.watch(bus), name="health-watch"))
        self._tasks.append(asyncio.create_task(self._recover_with_bus(), name="recover-with-bus"))
        self.bus_attached.set()

    async def _recover_with_bus(self) -> None:
        """Rollbacks that needed discovery (dynamic MIG, MPS, time-slicing) and failed at start run now."""
        if not self.checkpoint.by_state("PrepareStarted"):
            return
        await self.inventory.wait_live(timeout=10.0)
        done = await self.preparer.recover(only_failed=True)
        if done:
            log.info("interrupted prepares rolled back once discovery was reachable", claims=done)

    async def _watch_inventory(self, bus: Any) -> None:
        while True:
            try:
                await self.inventory.watch(bus)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - NATS away: try again
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from exc  # a cleanup error must not swallow our stop
                log.info("inventory watch interrupted; retrying", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(1.0)

    async def _cleanup_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.cleanup_interval)
            try:
                await self.preparer.recover(only_failed=True)
                await self.preparer.cleanup_stale()
            except Exception as exc:  # noqa: BLE001 - next round
                log.warning("stale-claim cleanup failed", error=str(exc))

    async def stop(self) -> None:
        for server, path in ((self._reg_server, self.registration_socket), (self._dra_server, self.dra_socket)):
            if server is not None:
                await server.stop(grace=1.0)
                sockets.remove(path)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()

    async def __aenter__(self) -> PreparerService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
