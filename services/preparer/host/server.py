"""The kubelet-facing gRPC surface: DRA `v1` and `v1beta1` DRAPlugin servicers over one driver's core.

Owns decoding requests, the server span per RPC (continuing the kubelet's W3C context from gRPC
metadata), per-request metrics, and encoding per-claim results: every claim of a request gets an
entry, and a per-claim failure is that entry's `error`, never a gRPC error.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.preparer.host import metrics
from services.preparer.host.checkpoint import PreparedDevice
from services.preparer.host.claimstate import ClaimPreparer, PrepareResult
from services.preparer.host.port import ClaimRef
from services.preparer.protos import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from shared.heap import BurstTrim
from shared.logs import get_logger
from shared.telemetry import extract_grpc_context, get_tracer, kubelet_context

log = get_logger(__name__)
tracer = get_tracer(__name__)
# the C heap handed back to the kernel when the process's last call in flight ends, once TRIM_AFTER claims
# were handled since the last time: right after a burst (64 concurrent calls take ~2.5 MB that glibc would
# keep until the 10 s tick, shared.heap), ~0.3 ms per TRIM_AFTER claims on a steady trickle
TRIM_AFTER = 64
HEAP_TRIM = BurstTrim(after=TRIM_AFTER)


def _refs(claims: Any) -> list[ClaimRef]:
    seen: dict[str, ClaimRef] = {}
    for c in claims:
        seen.setdefault(c.uid, ClaimRef(uid=c.uid, namespace=c.namespace, name=c.name))
    return list(seen.values())


class DraCore:
    """The version-independent handling of one RPC; the servicers below only translate messages."""

    def __init__(self, preparer: ClaimPreparer, driver: str) -> None:
        self.preparer = preparer
        self.driver = driver
        metrics.init(driver)
        # the labelled series of each operation, looked up once (labels() costs a lock and a dict walk a call)
        self._inflight = {op: metrics.INFLIGHT.labels(driver, op) for op in ("prepare", "unprepare")}
        self._requests = {op: metrics.REQUESTS.labels(driver, op) for op in ("prepare", "unprepare")}
        self._duration = {op: metrics.DURATION.labels(driver, op) for op in ("prepare", "unprepare")}

    async def _safe_prepare(self, ref: ClaimRef) -> PrepareResult:
        if not ref.uid or not ref.name or not ref.namespace:
            return PrepareResult(error=f"claim {ref} lacks a uid, name or namespace; the kubelet must send all three")
        try:
            return await self.preparer.prepare(ref)
        except Exception as exc:  # noqa: BLE001 - one claim's failure must not fail the others
            log.exception("prepare crashed", claim=str(ref))
            return PrepareResult(error=f"error preparing devices for claim {ref}: internal error: {exc}")

    async def _safe_unprepare(self, ref: ClaimRef) -> str:
        try:
            return await self.preparer.unprepare(ref)
        except Exception as exc:  # noqa: BLE001
            log.exception("unprepare crashed", claim=str(ref))
            return f"error unpreparing devices for claim {ref}: internal error: {exc}"

    async def run(
        self, operation: str, method: str, version: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> dict[str, Any]:
        refs = _refs(request.claims)
        if not refs:  # the health check's probe call (healthcheck.py): no span, no request metrics
            return {}
        parent = extract_grpc_context(context.invocation_metadata())
        # whether the kubelet sent a context: it then stays the parent of each claim's prepare span
        sent = trace.get_current_span(parent).get_span_context().is_valid
        start = time.perf_counter()
        with HEAP_TRIM.request(len(refs)):
            return await self._run(operation, method, version, refs, parent, sent, start)

    async def _run(
        self, operation: str, method: str, version: str, refs: list[ClaimRef], parent: Any, sent: bool, start: float
    ) -> dict[str, Any]:
        self._inflight[operation].inc()
        attributes: dict[str, str | int] = {
            "rpc.system": "grpc",
            "rpc.service": f"k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin",
            "rpc.method": method,
            "dra.claims": len(refs),
        }
        with (
            kubelet_context(sent),
            tracer.start_as_current_span(method, context=parent, kind=SpanKind.SERVER, attributes=attributes) as span,
        ):
            try:
                handle = self._safe_prepare if operation == "prepare" else self._safe_unprepare
                if len(refs) == 1:  # the common call: no task of its own
                    results: list[Any] = [await handle(refs[0])]
                else:
                    results = list(await asyncio.gather(*(handle(r) for r in refs)))
            finally:
                self._inflight[operation].dec()
            failed = [r for r in results if (r.error if isinstance(r, PrepareResult) else r)]
            if failed:
                span.set_status(Status(StatusCode.ERROR, f"{len(failed)} of {len(refs)} claims failed"))
                (metrics.PREPARE_ERRORS if operation == "prepare" else metrics.UNPREPARE_ERRORS).labels(
                    self.driver, "prepare_devices"
                ).inc(len(failed))
            else:
                self._requests[operation].inc()
        self._duration[operation].observe(time.perf_counter() - start)
        return {ref.uid: result for ref, result in zip(refs, results, strict=True)}


def _v1_device(dev: PreparedDevice) -> dra_v1_pb2.Device:
    out = dra_v1_pb2.Device(
        request_names=dev.requests, pool_name=dev.pool, device_name=dev.device, cdi_device_ids=dev.cdi_device_ids
    )
    if dev.share_id:
        out.share_id = dev.share_id
    return out


def _v1beta1_device(dev: PreparedDevice) -> dra_v1beta1_pb2.Device:
    return dra_v1beta1_pb2.Device(
        request_names=dev.requests, pool_name=dev.pool, device_name=dev.device, cdi_device_ids=dev.cdi_device_ids
    )


class _Servicer:
    """One DRA version's servicer: its messages (`pb2`, `device`) around the core."""

    version = ""
    pb2: Any = None
    device: Any = None

    def __init__(self, core: DraCore) -> None:
        self.core = core

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        results = await self.core.run("prepare", "NodePrepareResources", self.version, request, context)
        response = self.pb2.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]
            if result.error:
                entry.error = result.error
            else:
                entry.devices.extend(self.device(d) for d in result.devices)
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        results = await self.core.run("unprepare", "NodeUnprepareResources", self.version, request, context)
        response = self.pb2.NodeUnprepareResourcesResponse()
        for uid, error in results.items():
            response.claims[uid].error = error
        return response


class DraV1(_Servicer, dra_v1_pb2_grpc.DRAPluginServicer):
    version, pb2, device = "v1", dra_v1_pb2, staticmethod(_v1_device)


class DraV1beta1(_Servicer, dra_v1beta1_pb2_grpc.DRAPluginServicer):
    version, pb2, device = "v1beta1", dra_v1beta1_pb2, staticmethod(_v1beta1_device)


def add_dra_services(server: grpc.aio.Server, core: DraCore) -> None:
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(DraV1(core), server)
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(DraV1beta1(core), server)
