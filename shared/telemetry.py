"""Tracing set-up and W3C trace-context propagation through NATS headers and gRPC metadata.

Exporters: OTLP when OTEL_EXPORTER_OTLP_ENDPOINT (or _TRACES_ENDPOINT) is set, over
OTEL_EXPORTER_OTLP_PROTOCOL (`http/protobuf`, the default, or `grpc`); beside it, what `exporter` names:
"console", "file:<path>" (one JSON span per line, read by the terminal waterfall and tests, so the
demo's waterfall works beside OTLP), "memory" (in-process, for tests) or "none". With "none" (and no OTLP endpoint) no
SDK provider is installed: the API's no-op tracer hands out non-recording spans (no ids drawn, no attributes kept, no
processors), which still carry a caller's remote context through, so a kubelet's `traceparent` reaches
NATS headers and log lines all the same. With an exporter, the SDK's sampler decides (OTEL_TRACES_SAMPLER,
e.g. `parentbased_traceidratio` with OTEL_TRACES_SAMPLER_ARG): a span not sampled is not recorded;
periodic roots (PERIODIC) are kept at GPU_DRA_OTEL_PERIODIC_RATIO only. Spans go out through the SDK's
BatchSpanProcessor (OTEL_BSP_* settings), off the event loop's thread.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# The W3C context of a claim's trace, set by the scheduler when it allocates the claim; the preparer
# links to it (its parent when the kubelet sends no context of its own).
from shared.spanattrs import PERIODIC  # re-exported: the services mark periodic roots with it

CLAIM_TRACEPARENT_ANNOTATION = "gpu.nvidia.com/traceparent"

# Context key: True where the kubelet's RPC carried a trace context (the preparer keeps it as parent).
KUBELET_CONTEXT = otel_context.create_key("gpu_dra.kubelet_context")

DEFAULT_PERIODIC_RATIO = 0.01

_PROPAGATOR = TraceContextTextMapPropagator()
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
        return importlib.metadata.version("gpu-dra")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def setup_telemetry(
    service_name: str, exporter: str | None = None, *, node: str = "", periodic: float | None = None
) -> TracerProvider | None:
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
        service_name,
        chosen,
        otlp=otlp,
        node=node,
        periodic=periodic_ratio() if periodic is None else periodic,
        version=package_version(),
    )
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
    return inject_headers().get("traceparent", "")


def spans_made() -> bool:
    """Whether this process makes spans: `setup_telemetry` (the one way a service installs a provider)
    installed the SDK's. False while the API's no-op tracer stands, whose spans only carry the current
    context through: where that is all a span would do, a caller may carry the context itself."""
    return _provider is not None


def traceparent_context(traceparent: str) -> otel_context.Context:
    """A context whose parent is the span a stored `traceparent` names (empty context if none)."""
    return _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else otel_context.Context()


def span_link(traceparent: str) -> list[trace.Link]:
    """A link to the span a stored `traceparent` names (none if it names no valid span)."""
    context = trace.get_current_span(traceparent_context(traceparent)).get_span_context()
    return [trace.Link(context)] if context.is_valid else []


@contextlib.contextmanager
def kubelet_context(sent: bool) -> Iterator[None]:
    """Within: KUBELET_CONTEXT says whether the kubelet's call carried a trace context."""
    token = otel_context.attach(otel_context.set_value(KUBELET_CONTEXT, sent))
    try:
        yield
    finally:
        otel_context.detach(token)


def get_tracer(name: str) -> trace.Tracer:
    """The tracer of module `name` (the API's proxy: the installed provider's once there is one)."""
    return trace.get_tracer(name)


@contextlib.contextmanager
def leaf_span(
    tracer: trace.Tracer, name: str, attributes: Mapping[str, AttributeValue] | None = None
) -> Iterator[trace.Span]:
    """A span with no children (a file write, one API call): the current span's child, not made current;
    an exception escaping it is recorded on it, as `start_as_current_span` does."""
    with tracer.start_span(name, attributes=attributes) as span:
        yield span


_PRODUCER_TRACER = get_tracer("shared.bus")  # the producer spans' scope, as before they moved here


class ProducerSpan:
    """The span of a message's publish to `subject`, for a `with` block (it ends with the block); its parent is the
    current span or the one a stored `traceparent` names ("" for none). The block gets `headers` with the W3C
    context that continues it. Where no SDK makes spans none is started: the headers carry the parent's context
    as is (a plain object, not a generator: it is entered once per event published)."""

    __slots__ = ("_span", "headers")

    def __init__(self, name: str, subject: str, headers: dict[str, str], traceparent: str | None) -> None:
        self._span: contextlib.AbstractContextManager[trace.Span] | None = None
        self.headers = headers
        if spans_made():
            self._span = _PRODUCER_TRACER.start_as_current_span(
                name,
                context=None if traceparent is None else traceparent_context(traceparent),
                kind=trace.SpanKind.PRODUCER,
                attributes={"messaging.system": "nats", "messaging.destination.name": subject},
            )
        elif traceparent is None:
            self.headers = inject_headers(headers)
        elif traceparent:
            self.headers = {**headers, "traceparent": traceparent}

    def __enter__(self) -> dict[str, str]:
        if self._span is None:
            return self.headers
        self._span.__enter__()
        return inject_headers(self.headers)

    def __exit__(self, *exc: object) -> None:
        if self._span is not None:
            self._span.__exit__(*exc)  # type: ignore[arg-type]


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """W3C `traceparent`/`tracestate` of the current span, added to a NATS header dict."""
    carrier: dict[str, str] = dict(headers or {})
    _PROPAGATOR.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The remote parent context carried in NATS headers (an empty context if none)."""
    return _PROPAGATOR.extract(headers or {})


def inject_grpc_metadata(metadata: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """gRPC metadata pairs with trace context added (keys are lower-case as gRPC requires)."""
    return [*metadata, *inject_headers().items()]  # lower-case keys, as gRPC requires


def extract_grpc_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's context from gRPC invocation metadata."""
    carrier = {k: v if isinstance(v, str) else v.decode() for k, v in (metadata or ())}
    return _PROPAGATOR.extract(carrier)


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
    "setup_telemetry",
    "shutdown_telemetry",
    "span_link",
    "traceparent_context",
]
