"""The discovery run loop: open NVML (real or simulated), scan, publish on change, serve operations.

Owns the lifecycle: inventory to KV `dra-inventory/<node>` and `dra.v1.inventory.<node>` only when
the content hash changes, re-scans on a period and on NVML events, health monitoring, utilisation sampling
(`utilisation.Sampler`; under simulation the node's claims make its GPUs busy: `simload`) and the
device-operation handlers. Time-slicing and MPS run the driver root's binaries on a real node and
whenever a driver root is given (also under simulation); simulation without one runs none.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from prometheus_client import Histogram

from services.discovery import inventory, machine
from services.discovery.config import DiscoveryConfig, sim_state_file
from services.discovery.fabric import FabricPartitions, Fmpm
from services.discovery.healthevents import HealthMonitor
from services.discovery.mps import MpsManager
from services.discovery.mpsdaemon import CONTROL, MpsControl
from services.discovery.nvml import Nvml, load_real_binding
from services.discovery.operations import Operations
from services.discovery.simload import SimulatedLoad
from services.discovery.timeslice import Timeslices
from services.discovery.topology import normalise_bus_id
from services.discovery.utilisation import Sampler
from shared.bus import Bus
from shared.devicemodel import gpu_name
from shared.drivertools import DriverTools
from shared.events import catalog
from shared.events.inventory import NodeInventory
from shared.health import HEALTH
from shared.logs import get_logger
from shared.tasks import cancel_and_wait, raise_if_cancelling
from shared.telemetry import PERIODIC, get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)
SCAN_SECONDS = Histogram(
    "gpu_dra_nvml_scan_duration_seconds",
    "One NVML inventory scan of the node",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


def open_nvml(cfg: DiscoveryConfig) -> Nvml:
    """The NVML layer over the simulated binding (--simulate/--machine) or real pynvml.

    Raises MachineError for a bad spec and NvmlUnavailable when the library cannot be loaded.
    """
    if cfg.simulated:
        from services.discovery.simnvml import SimNvml  # the simulator is loaded only when asked for

        spec = machine.parse_spec(cfg.simulate) if cfg.simulate else machine.load_file(cfg.machine)
        state_file = sim_state_file(cfg.state_dir, cfg.node)
        return Nvml(SimNvml(cfg.node, spec, state_file, Path(cfg.dev_root)))
    return Nvml(load_real_binding(cfg.local_driver_root or None))


def driver_tools(cfg: DiscoveryConfig) -> DriverTools | None:
    """The driver root's binaries, when time-slicing and MPS are real (see DiscoveryConfig.runs_driver_tools)."""
    if not cfg.runs_driver_tools:
        return None
    return DriverTools.of(cfg.driver_root, cfg.container_driver_root, timeout=cfg.tool_timeout)


def fabric_partitions(cfg: DiscoveryConfig, nvml: Nvml, tools: DriverTools | None) -> FabricPartitions | None:
    """Fabric Manager's partitions when --fabric-manager-partitions is on: through fmpm under the driver
    root, or the simulated Fabric Manager on a simulated node without one."""
    if not cfg.fabric_manager_partitions:
        return None
    if tools is None:
        from services.discovery.simfabric import SimFabricManager, state_file

        return FabricPartitions(SimFabricManager(nvml, state_file(cfg.state_dir, cfg.node)))
    return FabricPartitions(
        Fmpm(tools, tool=cfg.fabric_manager_tool, socket=cfg.fabric_manager_socket, address=cfg.fabric_manager_address)
    )


class Scanner:
    """NVML → NodeInventory for one node (no bus), with the MPS and time-slice state discovery keeps."""

    def __init__(self, cfg: DiscoveryConfig, nvml: Nvml):
        self.cfg = cfg
        self.nvml = nvml
        self.tools = driver_tools(cfg)
        control = MpsControl(self.tools, ready_timeout=cfg.tool_timeout) if self.tools is not None else None
        self.mps = MpsManager(Path(cfg.mps_root), nvml, control)
        self.timeslices = Timeslices(Path(cfg.state_dir), nvml, self.tools)
        self.fabric = fabric_partitions(cfg, nvml, self.tools)
        self._loaded = False

    async def load(self) -> None:
        """Read the MPS and time-slice records kept on disk (once; scan calls it first)."""
        if not self._loaded:
            await self.mps.load()
            await self.timeslices.load()
            self._loaded = True

    async def scan(self) -> NodeInventory:
        await self.load()
        # a timer's scan (no parent) is periodic: sampled low; one a change asked for is in that trace
        with tracer.start_as_current_span("discovery.scan", attributes={PERIODIC: True}) as span, SCAN_SECONDS.time():
            facts = await self.nvml.call(self.nvml.read)
            applied = self.timeslices.current()
            if applied is not None:
                for g in facts.gpus:
                    g.timeslice = applied.get(g.uuid, 0)
            fabric = None
            if self.fabric is not None:
                fabric = await self.fabric.scan(
                    [(gpu_name(g.minor), normalise_bus_id(g.bus_id), g.module_id or 0) for g in facts.gpus]
                )
            inv = inventory.build(
                self.cfg.node,
                facts,
                dev_root=Path(self.cfg.dev_root),
                sys_root=Path(self.cfg.sys_root),
                simulated=self.nvml.simulated,
                mps=self.mps.by_gpu(ready_only=True),
                observed_at=time.time(),
                features=dict(self.cfg.gates),
                fabric=fabric,
            )
            span.set_attribute("gpu.count", len(inv.gpus))
            span.set_attribute("inventory.hash", inv.content_hash)
            return inv


class DiscoveryService:
    def __init__(self, cfg: DiscoveryConfig, nvml: Nvml, bus: Bus):
        self.cfg = cfg
        self.nvml = nvml
        self.bus = bus
        self.scanner = Scanner(cfg, nvml)
        self.kv: Any = None
        self.current: NodeInventory | None = None
        self.published_hash = ""
        self.published: NodeInventory | None = None  # the value this service last wrote to its KV key
        self.publish_count = 0
        self.key_repairs = 0
        self._scan_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self.health = HealthMonitor(
            cfg.node,
            nvml,
            bus,
            cfg.ignored,
            lambda: self.current,
            on_event=self._wake.set,
            timeout_ms=cfg.event_timeout_ms,
        )
        self.ops = Operations(
            cfg.node,
            nvml,
            self.scanner.mps,
            self.scanner.timeslices,
            self.health,
            lambda: self.current,
            self.rescan,
            fabric=self.scanner.fabric,
        )
        self.sampler = (
            Sampler(cfg.node, nvml, bus, cfg.telemetry_interval, lambda: self.current)
            if cfg.telemetry_interval > 0
            else None
        )
        self.ready = asyncio.Event()

    async def rescan(self) -> NodeInventory:
        """Scan now; publish to KV and the event stream only if the content hash changed."""
        async with self._scan_lock:
            inv = await self.scanner.scan()
            self.current = inv
            if inv.content_hash != self.published_hash:
                with tracer.start_as_current_span("discovery.publish-inventory"):
                    await self.kv.put(self.cfg.node, inv)
                    await self.bus.publish(
                        catalog.INVENTORY,
                        inv,
                        msg_id=f"inventory.{self.cfg.node}.{inv.content_hash}.{inv.observed_at}",
                        node=self.cfg.node,
                    )
                self.published_hash = inv.content_hash
                self.published = inv
                self.publish_count += 1
                log.info(
                    "inventory published",
                    node=self.cfg.node,
                    gpus=len(inv.gpus),
                    hash=inv.content_hash,
                    mig_devices=sum(len(g.mig_devices) for g in inv.gpus),
                )
            return inv

    async def guard_key(self, retry_s: float = 1.0) -> None:
        """Keep this node's KV entry what this service published: a value written under it by anyone else
        (garbage, another node's inventory, a delete) is overwritten with the true inventory as soon as
        the watch reports it. The publisher keeps a node's slices whatever the key holds; this repairs
        the key so that they follow the node's real inventory again. Restarted whenever NATS drops it."""
        while True:
            try:
                async for key, value in self.kv.watch(self.cfg.node, refused_as_none=True):
                    if key == self.cfg.node:
                        await self._repair_key(value)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - NATS away: watch again
                raise_if_cancelling()
                log.info("inventory key watch interrupted; retrying", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(retry_s)

    async def _repair_key(self, value: NodeInventory | None) -> None:
        async with self._scan_lock:  # after a rescan's own write has been noted as published
            ours = self.published
            if ours is None or (
                value is not None and value.node == ours.node and value.content_hash == ours.content_hash
            ):
                return  # ours (the hash covers the content), or nothing published yet
            log.warning(
                "this node's inventory key was changed by someone else; restoring it",
                node=self.cfg.node,
                bucket=catalog.INVENTORY_BUCKET.name,
                found="deleted or undecodable"
                if value is None
                else f"inventory of {value.node!r} hash {value.content_hash}",
            )
            self.key_repairs += 1  # counted first: a watcher may see the restored value before the put returns
            await self.kv.put(self.cfg.node, ours)

    async def start(self) -> None:
        await self.bus.provision()
        self.kv = await self.bus.kv(catalog.INVENTORY_BUCKET)
        last = await self.kv.get(self.cfg.node)
        if last is not None:
            self.published_hash = last.content_hash
            self.published = last
        await self.scanner.load()
        await self._check_tools()
        await self.scanner.mps.reconcile()
        await self.rescan()
        await self.health.start()
        await self.ops.serve(self.bus)
        if self.nvml.simulated and self.sampler is not None:
            await SimulatedLoad(self.cfg.node, self.nvml).subscribe(self.bus)
        self.ready.set()

    async def _check_tools(self) -> None:
        tools = self.scanner.tools
        if tools is None:
            return
        for name, needed_for in (("nvidia-smi", "time-slicing"), (CONTROL, "MPS")):
            if not await tools.has(name):
                log.warning(
                    "driver binary missing: claims that need it will fail to prepare",
                    binary=name,
                    needed_for=needed_for,
                    driver_root=str(tools.root.local("/")),
                )

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        guard = asyncio.create_task(self.guard_key(), name=f"inventory-key-guard-{self.cfg.node}")
        tasks = [guard]
        if self.sampler is not None:
            tasks.append(asyncio.create_task(self.sampler.run(stop), name=f"telemetry-{self.cfg.node}"))
        try:
            while not stop.is_set():
                waiter = asyncio.ensure_future(self._wake.wait())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait(
                    {waiter, stopper}, timeout=self.cfg.rescan_interval, return_when=asyncio.FIRST_COMPLETED
                )
                waiter.cancel()
                stopper.cancel()
                self._wake.clear()
                if stop.is_set():
                    break
                try:
                    await self.rescan()
                except Exception as exc:
                    log.exception("periodic re-scan failed", error=str(exc))
        finally:
            await cancel_and_wait(tasks)
            await self.ops.close()
            await self.health.stop()


async def run_service(cfg: DiscoveryConfig, bus: Bus, stop: asyncio.Event) -> None:
    """Open NVML first (a node without NVML publishes nothing), then run until `stop`."""
    nvml = open_nvml(cfg)
    service = DiscoveryService(cfg, nvml, bus)
    with HEALTH.check("first inventory scanned and published", service.ready.is_set):
        await nvml.start()
        try:
            await service.run(stop)
        finally:
            await nvml.close()
