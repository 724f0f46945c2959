"""The `gpu.nvidia.com` driver plugin: the GPU preparer and what it needs around it in the host.

Owns the wiring of the GPU side: the node's driver userspace for CDI (`commonedits`, built before
the sockets serve), the node's inventory (local cache first, then discovery's KV value), device
operations through discovery, the DRAResourceHealth stream on the DRA socket, the
rollback of interrupted prepares at start, and the rollbacks that had to wait for discovery. The
plain full-GPU path never waits for NATS.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import grpc

from services.preparer.gpu.commonedits import CommonEdits
from services.preparer.gpu.driver import GpuDriver
from services.preparer.gpu.healthwatch import HealthWatch, add_health_service
from services.preparer.gpu.vfio import VfioSettings, restore_bindings
from services.preparer.host.cdi import GPU_CDI
from services.preparer.host.devices import DeviceOps, Inventory
from services.preparer.host.metadatafiles import SUBDIR, MetadataFiles
from services.preparer.host.plugin import PluginContext
from shared import featuregates
from shared.bus import Bus
from shared.logs import get_logger

log = get_logger(__name__)


class GpuPlugin:
    def __init__(self, ctx: PluginContext) -> None:
        cfg = ctx.cfg
        self.common = CommonEdits(
            driver_root=cfg.driver_root,
            container_driver_root=cfg.container_driver_root,
            dev_root=cfg.dev_root,
            cdi_hook_path=cfg.cdi_hook_path,
        )
        self.inventory = Inventory(
            cfg.node,
            ctx.plugin_dir / "inventory-cache.json",
            dev_root=self.common.dev_root_override,
            dev_local=self.common.root.dev_local if self.common.configured else None,
        )
        self.ops = DeviceOps(cfg.node, timeout=cfg.device_op_timeout)
        metadata = (
            MetadataFiles(ctx.plugin_dir / SUBDIR, ctx.driver, durable=not ctx.checkpoint.power_loss_is_reboot)
            if cfg.gates.enabled(featuregates.DEVICE_METADATA)
            else None
        )
        self.gpus = GpuDriver(
            driver=ctx.driver,
            inventory=self.inventory,
            ops=self.ops,
            records=ctx.checkpoint,
            common=self.common,
            settings=ctx.settings,
            vfio=VfioSettings(
                sys_root=cfg.sys_root,
                proc_root=cfg.proc_root,
                modprobe=cfg.modprobe,
                free_timeout=cfg.vfio_free_timeout,
            ),
            gates=cfg.gates,
        )
        self.preparer = ctx.preparer(self.gpus, GPU_CDI, metadata)
        self.health = HealthWatch(cfg.node, self.inventory)

    async def start(self) -> None:
        """The driver's common CDI edits (DriverRootError for an unusable --driver-root), then the caches."""
        await self.common.start()
        await self.inventory.load_cache()
        await self.preparer.recover()
        await restore_bindings(self.preparer.checkpoint, self.gpus.passthrough)
        await self.preparer.sweep_specs()

    def add_services(self, server: grpc.aio.Server) -> None:
        add_health_service(server, self.health)

    def attach_bus(self, bus: Bus) -> dict[str, Coroutine[Any, Any, None]]:
        self.ops.bus = bus
        return {
            "inventory-watch": self.inventory.follow(bus),
            "health-watch": self.health.watch(bus),
            "recover-with-bus": self._recover_with_bus(),
        }

    async def _recover_with_bus(self) -> None:
        """Rollbacks that needed discovery (dynamic MIG, MPS, time-slicing) and failed at start run now."""
        if not self.preparer.checkpoint.by_state("PrepareStarted"):
            return
        await self.inventory.wait_live(timeout=10.0)
        done = await self.preparer.recover(only_failed=True)
        if done:
            log.info("interrupted prepares rolled back once discovery was reachable", claims=done)
