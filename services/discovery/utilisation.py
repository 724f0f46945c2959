"""Utilisation sampling: every `--telemetry-interval` seconds, SM %, memory, power and temperature of each GPU
and MIG device from NVML, published as ONE `NodeTelemetry` on `dra.v1.telemetry.<node>`.

Core NATS, not JetStream: a sample is worthless one interval later and the next replaces it, so storing it
would only fill a stream (1,000 nodes x 8 GPUs every 10 s is ~0.3 MB/s of writes) that nobody replays; a
consumer that was away shows a gap. The rate is bounded: at most one message per node per interval, on a
fixed schedule (a slow sample skips the ticks it overran rather than catching up in a burst), and the
NVML reads run on the NVML worker thread (`Nvml.call`), never on the event loop. Each round is a periodic
root span (sampled low), its publish a child carrying W3C trace context as every event does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.discovery.nvml import Nvml, SampleFacts
from shared.bus import Bus
from shared.events import catalog
from shared.events.inventory import NodeInventory
from shared.events.telemetry import DeviceSample, NodeTelemetry
from shared.logs import get_logger
from shared.telemetry import PERIODIC, get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)


def device_names(inventory: NodeInventory | None) -> dict[str, str]:
    """UUID -> device name of every GPU and MIG device in the inventory."""
    names: dict[str, str] = {}
    for gpu in inventory.gpus if inventory is not None else []:
        names[gpu.uuid] = gpu.name
        for mig in gpu.mig_devices:
            names[mig.uuid] = mig.name
    return names


def message(node: str, interval_s: float, names: dict[str, str], facts: list[SampleFacts]) -> NodeTelemetry:
    return NodeTelemetry(
        node=node,
        interval_s=interval_s,
        observed_at=time.time(),
        devices=[
            DeviceSample(
                device=names[f.uuid],
                uuid=f.uuid,
                sm_percent=f.sm_percent,
                memory_used_bytes=f.memory_used,
                memory_total_bytes=f.memory_total,
                power_mw=f.power_mw,
                temperature_c=f.temperature_c,
            )
            for f in facts
            if f.uuid in names
        ],
    )


class Sampler:
    """Samples the devices of the current inventory and publishes them, on a fixed schedule."""

    def __init__(
        self, node: str, nvml: Nvml, bus: Bus, interval_s: float, inventory: Callable[[], NodeInventory | None]
    ) -> None:
        self.node = node
        self.nvml = nvml
        self.bus = bus
        self.interval_s = interval_s
        self.inventory = inventory
        self.published = 0
        self.skipped = 0  # ticks a slow sample overran

    async def once(self) -> NodeTelemetry:
        names = device_names(self.inventory())
        with tracer.start_as_current_span("discovery.telemetry", attributes={PERIODIC: True}) as span:
            facts = await self.nvml.call(self.nvml.sample, list(names))
            sample = message(self.node, self.interval_s, names, facts)
            span.set_attribute("device.count", len(sample.devices))
            await self.bus.publish(catalog.TELEMETRY, sample, node=self.node)
        self.published += 1
        return sample

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not stop.is_set():
            try:
                await self.once()
            except Exception as exc:  # noqa: BLE001 - NATS away or NVML hiccup: the next tick tries again
                log.warning("utilisation sample not published", node=self.node, error=str(exc) or type(exc).__name__)
            due += self.interval_s
            now = loop.time()
            if now > due:  # overran: the next tick on the schedule, never a burst
                missed = int((now - due) // self.interval_s) + 1
                self.skipped += missed
                due += missed * self.interval_s
            try:
                await asyncio.wait_for(stop.wait(), due - now)
            except TimeoutError:
                pass
