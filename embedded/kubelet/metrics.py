"""The kubelet's DRA metrics under its own names and labels (pkg/kubelet/metrics, ALPHA), so dashboards and alerts
written for a real kubelet work against the emulator's /metrics (`--metrics-port`):

- `dra_operations_duration_seconds{operation_name,is_error}`: handling all claims of a pod when it starts
  (`PrepareResources`) or stops (`UnprepareResources`); the failures are the count with `is_error="true"`.
- `dra_grpc_operations_duration_seconds{driver_name,method_name,grpc_status_code}`: each gRPC call to a plugin,
  `method_name` the full method (`/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources`) and the code as
  Go spells it (`OK`, `DeadlineExceeded`, `Canceled`).
- `dra_resource_claims_in_use{driver_name}`: claims prepared on the node per driver, and `<any>` for all of them
  (a claim with devices of two drivers counts once there), read from the node's prepared claims when scraped.

Buckets are Prometheus' defaults, as the kubelet's (`metrics.DefBuckets`).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc
from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

ANY_DRIVER = "<any>"
OPERATIONS = Histogram(
    "dra_operations_duration_seconds",
    "Latency histogram in seconds for the duration of handling all ResourceClaims "
    "referenced by a pod when the pod is being started or shut down. Identified by the name of the operation "
    "(PrepareResources or UnprepareResources) and separated by the success of the operation.",
    ["operation_name", "is_error"],
)
GRPC_OPERATIONS = Histogram(
    "dra_grpc_operations_duration_seconds",
    "Duration in seconds of the DRA gRPC operations",
    ["driver_name", "method_name", "grpc_status_code"],
)


def go_code(code: grpc.StatusCode) -> str:
    """A gRPC status code as Go's `codes.Code.String()` says it: DEADLINE_EXCEEDED -> DeadlineExceeded."""
    if code == grpc.StatusCode.OK:
        return "OK"
    if code == grpc.StatusCode.CANCELLED:
        return "Canceled"
    return "".join(word.capitalize() for word in code.name.split("_"))


@contextlib.contextmanager
def grpc_call(driver: str, method: str) -> Iterator[Callable[[grpc.StatusCode], None]]:
    """Time one call; the caller says its code through the function yielded (OK unless it says otherwise)."""
    code = [grpc.StatusCode.OK]
    start = time.perf_counter()
    try:
        yield lambda said: code.__setitem__(0, said)
    finally:
        GRPC_OPERATIONS.labels(driver, method, go_code(code[0])).observe(time.perf_counter() - start)


@contextlib.contextmanager
def operation(name: str) -> Iterator[Callable[[bool], None]]:
    """Time `PrepareResources` or `UnprepareResources` of one pod; an exception, or the function yielded called
    with True, makes it an error."""
    failed = [False]
    start = time.perf_counter()
    try:
        yield lambda error: failed.__setitem__(0, error)
    except BaseException:
        failed[0] = True
        raise
    finally:
        OPERATIONS.labels(name, "true" if failed[0] else "false").observe(time.perf_counter() - start)


class _Prepared(Protocol):
    drivers: set[str]


class Preparing(Protocol):
    """What the collector reads of a node's prepared claims (`embedded.nodeagent.preparedclaims`): claim uid ->
    its drivers."""

    by_uid: dict[str, Any]


class _ClaimsInUse(Collector):
    """Counted when scraped from each node's tracked prepared claims."""

    def __init__(self) -> None:
        self._tracked: list[weakref.ref[Preparing]] = []

    def track(self, prepared: Preparing) -> None:
        self._tracked.append(weakref.ref(prepared))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "dra_resource_claims_in_use",
            "The number of ResourceClaims that are currently "
            "in use on the node, by driver name (driver_name label value) and across all "
            "drivers (special value <any> for driver_name).",
            labels=["driver_name"],
        )
        counts: dict[str, int] = {ANY_DRIVER: 0}
        for ref in list(self._tracked):
            prepared = ref()
            claims: list[_Prepared] = list(prepared.by_uid.values()) if prepared is not None else []
            for claim in claims:
                counts[ANY_DRIVER] += 1
                for driver in set(claim.drivers):
                    counts[driver] = counts.get(driver, 0) + 1
        for driver, count in sorted(counts.items()):
            family.add_metric([driver], count)
        yield family


CLAIMS_IN_USE = _ClaimsInUse()
REGISTRY.register(CLAIMS_IN_USE)
