"""Tracing set-up and W3C trace-context propagation through NATS headers and gRPC metadata.

Exporters: OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set; otherwise what `exporter` names:
"console", "file:<path>" (one JSON span per line, read by the terminal waterfall and tests),
"memory" (in-process, for tests) or "none". With "none" (and no OTLP endpoint) no SDK provider is
installed: the API's no-op tracer hands out non-recording spans (no ids drawn, no attributes kept, no
processors), which still carry a caller's remote context through, so a kubelet's `traceparent` reaches
NATS headers and log lines all the same. With an exporter, the SDK's sampler decides (OTEL_TRACES_SAMPLER,
e.g. `parentbased_traceidratio` with OTEL_TRACES_SAMPLER_ARG): a span not sampled is not recorded.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
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
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_memory_exporter: InMemorySpanExporter | None = None
_provider: TracerProvider | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a file, one JSON object a line (safe across processes: O_APPEND)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_to_dict(s)) + "\n" for s in spans)
        with self._lock, open(self._path, "a", encoding="utf-8") as out:
            out.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """A compact, stable JSON form of a finished span."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "service": (span.resource.attributes.get("service.name") if span.resource else None),
        "trace_id": format(ctx.trace_id, "032x") if ctx else "",
        "span_id": format(ctx.span_id, "016x") if ctx else "",
        "parent_span_id": format(parent.span_id, "016x") if parent else "",
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


def setup_telemetry(service_name: str, exporter: str | None = None) -> TracerProvider | None:
    """Install the process's tracer provider once (None: no exporter, the no-op tracer stays). Later
    calls return the first provider."""
    global _provider, _memory_exporter
    if _provider is not None:
        return _provider
    chosen = exporter if exporter is not None else os.environ.get("GPU_DRA_OTEL_EXPORTER", "none")
    otlp = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    if chosen == "none" and not otlp:
        return None  # spans cost nothing where nobody collects them (module doc)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif chosen == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif chosen.startswith("file:"):
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(chosen[5:])))
    elif chosen == "memory":
        _memory_exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(_memory_exporter))
    else:
        raise ValueError(f"unknown trace exporter {chosen!r}: use none, console, memory or file:<path>")
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def memory_spans() -> list[ReadableSpan]:
    """Finished spans held by the in-memory exporter (empty unless exporter == "memory")."""
    return list(_memory_exporter.get_finished_spans()) if _memory_exporter else []


def shutdown_telemetry() -> None:
    """Flush and stop exporters (call on service exit)."""
    if _provider is not None:
        _provider.force_flush()
        _provider.shutdown()


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """W3C `traceparent`/`tracestate` of the current span, added to a NATS header dict."""
    carrier: dict[str, str] = dict(headers or {})
    _PROPAGATOR.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The remote parent context carried in NATS headers (an empty context if none)."""
    return _PROPAGATOR.extract(dict(headers or {}))


def inject_grpc_metadata(metadata: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """gRPC metadata pairs with trace context added (keys are lower-case as gRPC requires)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return [*metadata, *((k.lower(), v) for k, v in carrier.items())]


def extract_grpc_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's context from gRPC invocation metadata."""
    carrier = {k: v if isinstance(v, str) else v.decode() for k, v in (metadata or ())}
    return _PROPAGATOR.extract(carrier)


__all__ = [
    "extract_context",
    "extract_grpc_context",
    "get_tracer",
    "inject_grpc_metadata",
    "inject_headers",
    "memory_spans",
    "propagate",
    "setup_telemetry",
    "shutdown_telemetry",
    "span_to_dict",
]
