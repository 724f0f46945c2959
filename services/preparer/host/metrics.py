"""Preparer metrics, `gpu_dra_*` as every service's (docs/operations.md maps them): the reference driver's
request counts and durations per operation, in-flight requests, prepared devices by type and errors by type,
with its labels and buckets (deploy/'s recording rules give them its `nvidia_dra_*` names too); shares of
devices and the outbox (Prometheus default registry)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.quantity import parse_quantity

if TYPE_CHECKING:
    from services.preparer.host.checkpoint import Checkpoint

BUCKETS = tuple(0.05 * 2**k for k in range(9))

REQUESTS = Counter("gpu_dra_requests", "Successful kubelet DRA requests", ["driver", "operation"])
DURATION = Histogram(
    "gpu_dra_request_duration_seconds", "Kubelet DRA request duration", ["driver", "operation"], buckets=BUCKETS
)
INFLIGHT = Gauge("gpu_dra_requests_inflight", "Kubelet DRA requests in progress", ["driver", "operation"])
PREPARE_ERRORS = Counter("gpu_dra_node_prepare_errors", "Claims that failed to prepare", ["driver", "error_type"])
UNPREPARE_ERRORS = Counter("gpu_dra_node_unprepare_errors", "Claims that failed to unprepare", ["driver", "error_type"])


def init(driver: str) -> None:
    """Pre-create the request series with zero values."""
    for op in ("prepare", "unprepare"):
        REQUESTS.labels(driver, op)
        DURATION.labels(driver, op)
        INFLIGHT.labels(driver, op)


DEVICE_TYPES = {"gpu.nvidia.com": ("gpu", "mig"), "compute-domain.nvidia.com": ("channel", "daemon")}


def prepared_counts(driver: str, checkpoint: Checkpoint) -> dict[str, int]:
    """Devices of the checkpoint's completed claims, by type (the driver's types, then "unknown")."""
    counts = dict.fromkeys((*DEVICE_TYPES.get(driver, ()), "unknown"), 0)
    for record in list(checkpoint.claims.values()):  # a copy: a scrape runs on the metrics server's thread
        if record.state != "PrepareCompleted":
            continue
        for dev in record.devices:
            counts[dev.kind if dev.kind in counts else "unknown"] += 1
    return counts


SHARE_CAPACITIES = ("memory", "compute", "shares")  # what a share consumes, in bytes, percent and shares


@dataclass
class HeldShares:
    """What one namespace's completed claims hold of one device: their shares, and the capacity they consume."""

    count: int = 0
    consumed: dict[str, float] = field(default_factory=dict)


def prepared_shares(checkpoint: Checkpoint) -> dict[tuple[str, str], HeldShares]:
    """Shares (KEP-5075: devices held with a shareID) of the checkpoint's completed claims, by (device,
    claim namespace): how many, and the sum of each SHARE_CAPACITIES capacity they consume."""
    held: dict[tuple[str, str], HeldShares] = {}
    for record in list(checkpoint.claims.values()):  # a copy: a scrape runs on the metrics server's thread
        if record.state != "PrepareCompleted":
            continue
        for dev in record.devices:
            if not dev.share_id:
                continue
            tally = held.setdefault((dev.device, record.namespace), HeldShares())
            tally.count += 1
            for name in SHARE_CAPACITIES:
                if name in dev.consumed_capacity:
                    amount = float(parse_quantity(dev.consumed_capacity[name]))
                    tally.consumed[name] = tally.consumed.get(name, 0.0) + amount
    return held


SHARES_HELP = (
    "Shares of a device (KEP-5075 consumable capacity) held by completed claims, by device and the "
    "claims' namespace. Not by share id or claim: those are new label values with every claim, so "
    "the series stay bounded by devices x tenants (a series goes when its last share does)."
)
SHARE_CAPACITY_HELP = (
    "Capacity the shares of a device held by completed claims consume, by device, the claims' namespace and "
    "capacity: memory in bytes, compute in percent of the SMs, shares in shares (as gpu_dra_prepared_shares, "
    "not by share id or claim)."
)


class _PreparedDevices(Collector):
    """`gpu_dra_prepared_devices{node,driver,device_type}`, `gpu_dra_prepared_shares{node,driver,device,
    namespace}` (SHARES_HELP) and `gpu_dra_prepared_share_capacity{...,capacity}` (SHARE_CAPACITY_HELP),
    counted from each tracked checkpoint when it is scraped: nothing to keep up to date on the prepare path (a
    count per change was O(claims) per claim)."""

    def __init__(self) -> None:
        self._tracked: dict[tuple[str, str], weakref.ref[Checkpoint]] = {}

    def track(self, node: str, driver: str, checkpoint: Checkpoint) -> None:
        self._tracked[(node, driver)] = weakref.ref(checkpoint)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "gpu_dra_prepared_devices", "Devices in completed claims", labels=["node", "driver", "device_type"]
        )
        shares = GaugeMetricFamily(
            "gpu_dra_prepared_shares", SHARES_HELP, labels=["node", "driver", "device", "namespace"]
        )
        consumed = GaugeMetricFamily(
            "gpu_dra_prepared_share_capacity",
            SHARE_CAPACITY_HELP,
            labels=["node", "driver", "device", "namespace", "capacity"],
        )
        for (node, driver), ref in list(self._tracked.items()):
            checkpoint = ref()
            if checkpoint is not None:
                for kind, count in prepared_counts(driver, checkpoint).items():
                    family.add_metric([node, driver, kind], count)
                for (device, namespace), held in sorted(prepared_shares(checkpoint).items()):
                    shares.add_metric([node, driver, device, namespace], held.count)
                    for name, amount in sorted(held.consumed.items()):
                        consumed.add_metric([node, driver, device, namespace, name], amount)
        yield family
        yield shares
        yield consumed


PREPARED = _PreparedDevices()
REGISTRY.register(PREPARED)


def track_prepared(node: str, driver: str, checkpoint: Checkpoint) -> None:
    """Count `checkpoint`'s prepared devices as (node, driver)'s from now on (the latest checkpoint tracked wins)."""
    PREPARED.track(node, driver, checkpoint)


OUTBOX_EVENTS = Gauge("gpu_dra_outbox_events", "Lifecycle events in the outbox not yet stored by JetStream", ["driver"])
OUTBOX_DROPPED = Counter("gpu_dra_outbox_dropped", "Lifecycle events refused because the outbox was full", ["driver"])
