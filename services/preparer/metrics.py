"""Preparer metrics under the reference driver's names and labels (`nvidia_dra_*`, so its dashboards and
alerts work): request counts and durations per operation, in-flight requests, prepared devices by type,
and errors by type; ours (`gpu_dra_*`) for the outbox (Prometheus default registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from services.preparer.checkpoint import Checkpoint

BUCKETS = tuple(0.05 * 2**k for k in range(9))

REQUESTS = Counter("nvidia_dra_requests", "Successful kubelet DRA requests", ["driver", "operation"])
DURATION = Histogram("nvidia_dra_request_duration_seconds", "Kubelet DRA request duration", ["driver", "operation"],
                     buckets=BUCKETS)
INFLIGHT = Gauge("nvidia_dra_requests_inflight", "Kubelet DRA requests in progress", ["driver", "operation"])
PREPARED = Gauge("nvidia_dra_prepared_devices", "Devices in completed claims", ["node", "driver", "device_type"])
PREPARE_ERRORS = Counter("nvidia_dra_node_prepare_errors", "Claims that failed to prepare", ["driver", "error_type"])
UNPREPARE_ERRORS = Counter("nvidia_dra_node_unprepare_errors", "Claims that failed to unprepare", ["driver", "error_type"])


def init(driver: str) -> None:
    """Pre-create the request series with zero values."""
    for op in ("prepare", "unprepare"):
        REQUESTS.labels(driver, op)
        DURATION.labels(driver, op)
        INFLIGHT.labels(driver, op)


DEVICE_TYPES = {"gpu.nvidia.com": ("gpu", "mig"), "compute-domain.nvidia.com": ("channel", "daemon")}


def set_prepared(node: str, driver: str, checkpoint: Checkpoint) -> None:
    counts = dict.fromkeys((*DEVICE_TYPES.get(driver, ()), "unknown"), 0)
    for record in checkpoint.claims.values():
        if record.state != "PrepareCompleted":
            continue
        for dev in record.devices:
            counts[dev.kind if dev.kind in counts else "unknown"] += 1
    for kind, count in counts.items():
        PREPARED.labels(node, driver, kind).set(count)

OUTBOX_EVENTS = Gauge("gpu_dra_outbox_events", "Lifecycle events in the outbox not yet stored by JetStream", ["driver"])
OUTBOX_DROPPED = Counter("gpu_dra_outbox_dropped", "Lifecycle events refused because the outbox was full", ["driver"])
