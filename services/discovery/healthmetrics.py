"""`gpu_dra_device_healthy`: one series per device of the node from the first scan on, labelled as DCGM-exporter
labels its per-device series (`UUID`, `modelName`, `Hostname`), so it joins with DCGM's and with
`gpu_dra_device_allocation_info` by UUID. Counted when scraped from each tracked monitor's inventory and last
health (nothing to keep in step on the event path); 1 healthy, 0 not (Unhealthy or Unknown)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.events.health import DeviceHealth
from shared.events.inventory import NodeInventory

LABELS = ["node", "device", "UUID", "modelName", "Hostname"]


class Monitored(Protocol):
    """What the collector reads of a health monitor (`healthevents.HealthMonitor`)."""

    last: dict[str, DeviceHealth]

    def inventory(self) -> NodeInventory | None: ...


def health_samples(
    node: str, inventory: NodeInventory | None, last: Mapping[str, DeviceHealth]
) -> list[tuple[list[str], float]]:
    """(label values, value) per device: the inventory's GPUs and MIG devices, then devices known only from a
    health report (a GPU that fell off the bus)."""
    out: list[tuple[list[str], float]] = []
    seen: set[str] = set()

    def add(device: str, uuid: str, model: str) -> None:
        seen.add(device)
        state = last.get(device)
        out.append(([node, device, uuid, model, node], 1.0 if state is None or state.state == "Healthy" else 0.0))

    for gpu in inventory.gpus if inventory is not None else []:
        add(gpu.name, gpu.uuid, gpu.product_name)
        for mig in gpu.mig_devices:
            add(mig.name, mig.uuid, gpu.product_name)
    for device, state in list(last.items()):
        if device not in seen:
            add(device, state.uuid, "")
    return out


class _DeviceHealthCollector(Collector):
    def __init__(self) -> None:
        self._tracked: dict[str, weakref.ref[Monitored]] = {}

    def track(self, node: str, monitor: Monitored) -> None:
        self._tracked[node] = weakref.ref(monitor)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "gpu_dra_device_healthy",
            "1 healthy, 0 unhealthy or unknown; every device of the node from its first scan",
            labels=LABELS,
        )
        for node, ref in list(self._tracked.items()):
            monitor = ref()
            if monitor is not None:
                for labels, value in health_samples(node, monitor.inventory(), dict(monitor.last)):
                    family.add_metric(labels, value)
        yield family


DEVICE_HEALTH = _DeviceHealthCollector()
REGISTRY.register(DEVICE_HEALTH)
