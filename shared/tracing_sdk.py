"""The OpenTelemetry SDK side of tracing, loaded only by a process that exports spans.

`shared.telemetry` is what every module uses (tracers, W3C propagation, `setup_telemetry`); this
module holds what recording and exporting need: the provider with its resource and sampler, the
span processors per exporter, the span-file exporter and its record format. A process without an
exporter never imports it (nor the SDK: ~2.5 MB and its import time).
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Sampler, SamplingResult, TraceIdRatioBased

from shared.spanattrs import PERIODIC


def build_provider(
    service_name: str, chosen: str, *, otlp: bool, node: str, periodic: float, version: str = ""
) -> tuple[TracerProvider, InMemorySpanExporter | None]:
    """The provider for `chosen` ("console", "file:<path>", "memory", "none") beside OTLP when `otlp`;
    and the in-memory exporter when "memory" was chosen. The SDK reads its sampler (OTEL_TRACES_SAMPLER)
    and its batch settings (OTEL_BSP_*) from the environment."""
    provider = TracerProvider(resource=service_resource(service_name, node, version))
    provider.sampler = PeriodicSampler(provider.sampler, periodic)  # before any tracer is made
    memory: InMemorySpanExporter | None = None
    if otlp:
        provider.add_span_processor(BatchSpanProcessor(otlp_exporter()))
    if chosen == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif chosen.startswith("file:"):
        # the span file's batch delay: OTEL_BSP_SCHEDULE_DELAY where set (as for OTLP), FILE_EXPORT_DELAY_MS if not
        delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else FILE_EXPORT_DELAY_MS
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(chosen[5:]), schedule_delay_millis=delay))
    elif chosen == "memory":
        memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(memory))
    elif chosen not in ("none", ""):  # none beside OTLP: OTLP only
        raise ValueError(f"unknown trace exporter {chosen!r}: use none, console, memory or file:<path>")
    return provider, memory


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a file, one JSON object a line (safe across processes: O_APPEND).

    It runs behind a BatchSpanProcessor (FILE_EXPORT_DELAY_MS), so a span's encoding and write happen
    on the processor's thread, not on the event loop of the work being traced; a span is in the file
    within ~FILE_EXPORT_DELAY_MS of its end, and every span is on shutdown (`shutdown_telemetry`)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        encode = _SPAN_JSON.encode
        lines = b"".join(encode(span_to_dict(s)) + b"\n" for s in spans)
        with self._lock, open(self._path, "ab") as out:
            out.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


# How long a finished span waits for others to share its file write (the file exporter's batch delay).
FILE_EXPORT_DELAY_MS = 50
_SPAN_JSON = msgspec.json.Encoder(enc_hook=str)  # attribute values that JSON lacks (tuples are lists) as text


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """A compact, stable JSON form of a finished span."""
    own, up, resource = span.get_span_context(), span.parent, span.resource.attributes
    return {
        "name": span.name,
        "service": resource.get("service.name"),
        "node": resource.get("k8s.node.name", ""),
        "trace_id": f"{own.trace_id:032x}" if own else "",
        "span_id": f"{own.span_id:016x}" if own else "",
        "parent_span_id": f"{up.span_id:016x}" if up else "",
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
            for link in span.links
        ],
    }


class PeriodicSampler(Sampler):
    """Root spans marked PERIODIC: sampled at `ratio`; every other span: as `base` (the env's) decides."""

    def __init__(self, base: Sampler, ratio: float) -> None:
        self.base = base
        self.periodic = TraceIdRatioBased(ratio)

    def should_sample(
        self,
        parent_context: otel_context.Context | None,
        trace_id: int,
        name: str,
        kind: trace.SpanKind | None = None,
        attributes: Any = None,
        links: Sequence[trace.Link] | None = None,
        trace_state: trace.TraceState | None = None,
    ) -> SamplingResult:
        root = not trace.get_current_span(parent_context).get_span_context().is_valid
        chosen = self.periodic if root and attributes and attributes.get(PERIODIC) else self.base
        return chosen.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"PeriodicSampler{{{self.periodic.get_description()},{self.base.get_description()}}}"


def service_resource(service: str, node: str = "", version: str = "") -> Resource:
    """The resource of one process: `service.name` names the logical service (`gpu-dra-preparer`, never
    the node: N nodes are one service with N instances), `service.instance.id` this process,
    `service.version` the package, `k8s.node.name` the node where there is one. `service` is the
    process's log name (`preparer-<node>`, `scheduler`, ...); OTEL_RESOURCE_ATTRIBUTES adds to these."""
    logical = service[: -len(node) - 1] if node and service.endswith(f"-{node}") else service
    attributes: dict[str, str] = {
        "service.name": logical if logical.startswith("gpu-dra") else f"gpu-dra-{logical}",
        "service.namespace": "gpu-dra",
        "service.instance.id": f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}",
        "service.version": version,
    }
    if node:
        attributes["k8s.node.name"] = node
    return Resource.create(attributes)


def otlp_exporter() -> SpanExporter:
    """The OTLP span exporter OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL names (`http/protobuf` or `grpc`)."""
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: use grpc or http/protobuf "
        "(http/json is not implemented by the Python SDK)"
    )
