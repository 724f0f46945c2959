"""In-process discovery on a simulated machine, for tests and the local cluster.

`running_discovery` starts the same `DiscoveryService` the CLI runs, over a given Bus, with the
simulated NVML state and fake `/dev` tree under `root`, and stops it on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from services.discovery.config import DiscoveryConfig
from services.discovery.service import DiscoveryService, Scanner, open_nvml
from shared.bus import Bus
from shared.events import catalog
from shared.events.inventory import NodeInventory


class RunningDiscovery:
    """A started discovery service; `inventory` is what it last scanned."""

    def __init__(self, service: DiscoveryService):
        self.service = service

    @property
    def inventory(self) -> NodeInventory:
        assert self.service.current is not None, "discovery has not scanned yet"
        return self.service.current

    @property
    def config(self) -> DiscoveryConfig:
        return self.service.cfg

    async def rescan(self) -> NodeInventory:
        return await self.service.rescan()

    async def overwrite_key(self, bus: Bus, garbage: bytes) -> NodeInventory:
        """Write `garbage` over this node's inventory key as `bus`'s identity, then return the first
        value stored after it: the one this service wrote back (ordered by revision)."""
        kv = await bus.kv(catalog.INVENTORY_BUCKET)
        node = self.config.node
        watcher = await kv.open_watch(node)
        try:
            written = (await bus.js.publish(f"$KV.{catalog.INVENTORY_BUCKET.name}.{node}", garbage)).seq
            async for entry in kv.updates(watcher):
                if entry is None or int(entry.revision or 0) <= written:
                    continue
                value: NodeInventory | None = kv.decode(node, entry.value, int(entry.revision or 0))
                assert value is not None, f"{node}'s key was rewritten with {entry.value!r}"
                return value
        finally:
            await watcher.stop()
        raise AssertionError("the watch ended")


@contextlib.asynccontextmanager
async def running_discovery(
    bus: Bus,
    node: str = "n1",
    simulate: str = "h100x8",
    root: Path | str = "/tmp/gpu-dra-sim",
    machine: str = "",
    rescan_interval: float = 30.0,
    **overrides: object,
) -> AsyncIterator[RunningDiscovery]:
    """Run discovery for `node` on a simulated machine (`simulate` spec or `machine` YAML file). Its health
    thread waits for NVML events 100 ms at a time (the service's default: 1 s), so that leaving the block, which
    waits for that thread before NVML shuts down, takes a tenth of a second, not one."""
    root = Path(root) / node
    cfg = DiscoveryConfig(
        node=node,
        simulate="" if machine else simulate,
        machine=machine,
        dev_root=str(root),
        rescan_interval=rescan_interval,
        **{"event_timeout_ms": 100, **overrides},  # type: ignore[arg-type]
    ).resolved()
    nvml = open_nvml(cfg)
    await nvml.start()
    service = DiscoveryService(cfg, nvml, bus)
    stopping = asyncio.Event()
    task = asyncio.create_task(service.run(stopping), name=f"discovery-{node}")
    ready = asyncio.create_task(service.ready.wait())
    try:
        done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises why it stopped
            raise RuntimeError(f"discovery for {node} stopped before it was ready")
        yield RunningDiscovery(service)
    finally:
        ready.cancel()
        stopping.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await nvml.close()


async def scan_simulated(
    root: Path | str, node: str = "n1", simulate: str = "h100x8", machine: str = ""
) -> NodeInventory:
    """Scan a simulated machine once, without a bus: what `gpu-dra discovery --once` prints.

    The fake `/dev` tree and simulated NVML state live under `root/<node>`.
    """
    dev = Path(root) / node
    cfg = DiscoveryConfig(
        node=node, simulate="" if machine else simulate, machine=machine, dev_root=str(dev)
    ).resolved()
    nvml = open_nvml(cfg)
    await nvml.start()
    try:
        return await Scanner(cfg, nvml).scan()
    finally:
        await nvml.close()
