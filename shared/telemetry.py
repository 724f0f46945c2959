"""Tracing set-up and W3C trace-context propagation through NATS headers and gRPC metadata.

Exporters: OTLP when OTEL_EXPORTER_OTLP_ENDPOINT (or _TRACES_ENDPOINT) is set, over
OTEL_EXPORTER_OTLP_PROTOCOL (`http/protobuf`, the default, or `grpc`); beside it, what `exporter` names:
"console", "file:<path>" (one JSON span per line, read by the terminal waterfall and tests, so the
demo's waterfall works beside OTLP), "memory" (in-process, for tests) or "none". With "none" (and no OTLP endpoint) no SDK provider is
installed: the API's no-op tracer hands out non-recording spans (no ids drawn, no attributes kept, no
processors), which still carry a caller's remote context through, so a kubelet's `traceparent` reaches
NATS headers and log lines all the same. With an exporter, the SDK's sampler decides (OTEL_TRACES_SAMPLER,
e.g. `parentbased_traceidratio` with OTEL_TRACES_SAMPLER_ARG): a span not sampled is not recorded;
periodic roots (PERIODIC) are kept at GPU_DRA_OTEL_PERIODIC_RATIO only.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation import _SPAN_KEY
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from shared import distversion
from shared.tracing_live import LiveSpan

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# The W3C context of a claim's trace, set by the scheduler when it allocates the claim; the preparer
# links to it (its parent when the kubelet sends no context of its own).
CLAIM_TRACEPARENT_ANNOTATION = "gpu.nvidia.com/traceparent"

# Context key: True where the kubelet's RPC carried a trace context (the preparer keeps it as parent).
KUBELET_CONTEXT = otel_context.create_key("gpu_dra.kubelet_context")

# A span attribute marking periodic work (a scan, a resync) that is its own root: PeriodicSampler
# samples such roots at GPU_DRA_OTEL_PERIODIC_RATIO (default 0.01), so thousands of nodes' no-op
# passes do not flood the backend; what such a pass changes is traced in spans of its own.
PERIODIC = "gpu_dra.periodic"
DEFAULT_PERIODIC_RATIO = 0.01

_PROPAGATOR = TraceContextTextMapPropagator()
# A version-00 `traceparent` as this project writes it (and most do): read without the propagator's
# per-call pattern look-up; anything else (another version, spacing, upper case) goes to the propagator.
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_TRACE_FLAGS = tuple(trace.TraceFlags(bits) for bits in range(256))
_memory_exporter: InMemorySpanExporter | None = None
_provider: TracerProvider | None = None


def periodic_ratio() -> float:
    """GPU_DRA_OTEL_PERIODIC_RATIO: the share of periodic root spans kept (0..1)."""
    raw = os.environ.get("GPU_DRA_OTEL_PERIODIC_RATIO", "")
    try:
        ratio = float(raw) if raw else DEFAULT_PERIODIC_RATIO
    except ValueError:
        raise ValueError(f"GPU_DRA_OTEL_PERIODIC_RATIO={raw!r} is not a number: give a ratio from 0 to 1") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"GPU_DRA_OTEL_PERIODIC_RATIO={raw!r} is out of range: give a ratio from 0 to 1")
    return ratio


def package_version() -> str:
    """The installed gpu-dra version (`service.version`, `gpu_dra_build_info`)."""
    try:
        return distversion.version("gpu-dra")  # not importlib.metadata: ~1 MB (distversion's doc)
    except distversion.PackageNotFoundError:
        return "0.0.0+unknown"


def setup_telemetry(service_name: str, exporter: str | None = None, *, node: str = "",
                    periodic: float | None = None) -> TracerProvider | None:
    """Install the process's tracer provider once (None: no exporter, the no-op tracer stays). Later
    calls return the first provider. Head sampling is the SDK's, from OTEL_TRACES_SAMPLER/_ARG;
    `periodic`: the ratio of PERIODIC roots kept (None: GPU_DRA_OTEL_PERIODIC_RATIO's)."""
    global _provider, _memory_exporter
    if _provider is not None:
        return _provider
    chosen = exporter if exporter is not None else os.environ.get("GPU_DRA_OTEL_EXPORTER", "none")
    otlp = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    if chosen == "none" and not otlp:
        return None  # spans cost nothing where nobody collects them (module doc)
    from shared import tracing_sdk  # the SDK is loaded only by a process that exports spans

    provider, _memory_exporter = tracing_sdk.build_provider(
        service_name, chosen, otlp=otlp, node=node, periodic=periodic_ratio() if periodic is None else periodic)
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


def current_traceparent() -> str:
    """The W3C `traceparent` of the current span ("" when there is none to continue, e.g. no-op)."""
    context = _current_span_context()
    return "" if context == trace.INVALID_SPAN_CONTEXT else _traceparent(context)


def _current_span_context() -> trace.SpanContext:
    """`trace.get_current_span().get_span_context()`, in fewer calls."""
    span: Any = otel_context.get_current().get(_SPAN_KEY)
    known = type(span)
    if known is LiveSpan or known is trace.NonRecordingSpan or isinstance(span, trace.Span):
        context: trace.SpanContext = span.get_span_context()
        return context
    return trace.INVALID_SPAN_CONTEXT


def _traceparent(context: trace.SpanContext) -> str:
    # a span context is a tuple: trace id, span id, is remote, flags, state, is valid
    return f"00-{context[0]:032x}-{context[1]:016x}-{context[3]:02x}"


def _inject(carrier: dict[str, str]) -> None:
    """What the W3C propagator's `inject` writes for the current span, into `carrier`."""
    context = _current_span_context()
    if context == trace.INVALID_SPAN_CONTEXT:
        return
    carrier["traceparent"] = _traceparent(context)
    if context.trace_state:
        carrier["tracestate"] = context.trace_state.to_header()


def _extract(carrier: Mapping[str, str]) -> otel_context.Context:
    """What the W3C propagator's `extract` reads from `carrier` (a `tracestate` too: then the propagator itself)."""
    if "tracestate" in carrier:
        return _PROPAGATOR.extract(dict(carrier))
    return traceparent_context(carrier.get("traceparent") or "")


def traceparent_context(traceparent: str) -> otel_context.Context:
    """A context whose parent is the span a stored `traceparent` names (empty context if none), as the W3C
    propagator reads it."""
    if not traceparent:
        return otel_context.Context()
    parent = _remote_span_context(traceparent)
    if parent is None:
        return _PROPAGATOR.extract({"traceparent": traceparent})
    if not parent[5]:
        return otel_context.Context()
    return otel_context.Context({_SPAN_KEY: trace.NonRecordingSpan(parent)})


def _remote_span_context(traceparent: str) -> trace.SpanContext | None:
    """The remote span context a `traceparent` of the common form names (an invalid one for zero ids), made as
    the API's `SpanContext` makes it; None for any other form (the propagator reads those)."""
    match = _TRACEPARENT.fullmatch(traceparent)
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return trace.INVALID_SPAN_CONTEXT
    # the API's SpanContext.__new__ for ids in range (32 and 16 hex digits, not zero): valid
    return tuple.__new__(trace.SpanContext, (trace_id, span_id, True, _TRACE_FLAGS[int(match[3], 16)],
                                             trace.DEFAULT_TRACE_STATE, True))


def span_link(traceparent: str) -> list[trace.Link]:
    """A link to the span a stored `traceparent` names (none if it names no valid span)."""
    if not traceparent:
        return []
    ctx = _remote_span_context(traceparent)
    if ctx is None:
        ctx = trace.get_current_span(_PROPAGATOR.extract({"traceparent": traceparent})).get_span_context()
    return [trace.Link(ctx)] if ctx.is_valid else []


@contextlib.contextmanager
def kubelet_context(sent: bool) -> Iterator[None]:
    """Within: KUBELET_CONTEXT says whether the kubelet's call carried a trace context."""
    token = otel_context.attach(otel_context.set_value(KUBELET_CONTEXT, sent))
    try:
        yield
    finally:
        otel_context.detach(token)


class ModuleTracer(trace.ProxyTracer):
    """A module's tracer, made at import (before `setup_telemetry` installs a provider): the API's proxy,
    which uses the provider's tracer once there is one and the no-op tracer until then, except that
    `start_as_current_span` hands out the real tracer's context manager itself; the API's wraps it in
    a generator-based one of its own, a second enter and exit per span. With no SDK (no exporter) it is
    `NoOpCurrentSpan`: the no-op tracer's answer without its two generators."""

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        tracer = self._tracer
        if type(tracer) is trace.NoOpTracer:
            return NoOpCurrentSpan(kwargs.get("context", args[1] if len(args) > 1 else None))
        return tracer.start_as_current_span(*args, **kwargs)


class NoOpCurrentSpan:
    """What the API's no-op tracer's `start_as_current_span` does (`with` only): the span it starts (the
    current non-recording span, carrying a remote caller's context on, or one for the given context's parent)
    made current for the block. When that is the current span already, nothing is attached."""

    __slots__ = ("_context", "_token")

    def __init__(self, context: otel_context.Context | None) -> None:
        self._context = context
        self._token: object = None

    def __enter__(self) -> trace.Span:
        context = self._context
        current = trace.get_current_span()
        span = current if context is None and isinstance(current, trace.NonRecordingSpan) \
            else _NO_OP_TRACER.start_span("", context)
        if span is not current:
            self._token = otel_context.attach(otel_context.Context({**otel_context.get_current(), _SPAN_KEY: span}))
        return span

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]


_NO_OP_TRACER = trace.NoOpTracer()


def get_tracer(name: str) -> trace.Tracer:
    """The tracer of module `name` (ModuleTracer)."""
    return ModuleTracer(name)


class leaf_span:  # noqa: N801 - a context manager used as a function
    """A span with no children (a file write, one API call): the current span's child, started on entry and
    ended on exit without becoming the current span itself, so it costs no context switch in and out; an
    exception escaping it is recorded on it, as `start_as_current_span` does. (A class, not a generator: one
    is made per write on the node's hot path.)"""

    __slots__ = ("_attributes", "_name", "_span", "_tracer")

    def __init__(self, tracer: trace.Tracer, name: str, attributes: Mapping[str, AttributeValue] | None = None,
                 ) -> None:
        self._tracer, self._name, self._attributes = tracer, name, attributes
        self._span: trace.Span = trace.INVALID_SPAN

    def __enter__(self) -> trace.Span:
        self._span = self._tracer.start_span(self._name, attributes=self._attributes)
        return self._span

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        span = self._span
        try:
            if exc is not None and span.is_recording():
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        finally:
            span.end()


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """W3C `traceparent`/`tracestate` of the current span, added to a NATS header dict."""
    carrier: dict[str, str] = dict(headers or {})
    _inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The remote parent context carried in NATS headers (an empty context if none)."""
    return _extract(headers or {})


def inject_grpc_metadata(metadata: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """gRPC metadata pairs with trace context added (keys are lower-case as gRPC requires)."""
    carrier: dict[str, str] = {}
    _inject(carrier)
    return [*metadata, *carrier.items()]  # lower-case keys, as gRPC requires


def extract_grpc_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's context from gRPC invocation metadata."""
    carrier = {k: v if isinstance(v, str) else v.decode() for k, v in (metadata or ())}
    return _extract(carrier)


__all__ = [
    "PERIODIC",
    "CLAIM_TRACEPARENT_ANNOTATION",
    "KUBELET_CONTEXT",
    "extract_context",
    "extract_grpc_context",
    "get_tracer",
    "inject_grpc_metadata",
    "current_traceparent",
    "inject_headers",
    "kubelet_context",
    "leaf_span",
    "memory_spans",
    "package_version",
    "propagate",
    "setup_telemetry",
    "shutdown_telemetry",
    "span_link",
    "traceparent_context",
]
