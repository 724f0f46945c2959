"""A cheaper way for the OpenTelemetry SDK to record a span, in the SDK's own model.

The SDK's `Tracer.start_span` builds a `_Span` whose attributes live in a `BoundedAttributes` (its own
lock, every value re-validated by `_clean_attribute_value`: ~20% of a span's cost), whose events and
links are `BoundedList`s (a deque and a lock each) made even when a span never gets one, and whose
`end()` copies the span into a fresh `ReadableSpan` for the processors. `RecordingTracer` starts a
`RecordedSpan` instead, which:

- sets only the fields that differ from span to span: what every span starts with is on the class, what
  the tracer's spans share (resource, scope, limits, processors) is read through the tracer's setup;
- keeps the attributes it is given as they were given, and stores them when they are first read (by an
  exporter, on its thread): a `str`, `bool`, `int` or `float` value with a non-empty `str` key (what our
  code builds) as is; anything else through the SDK's own cleaning (`_clean_attribute_value`: sequences to
  tuples, other types to text or dropped); the count limit (`max_span_attributes`) holds as in the SDK
  (oldest dropped, counted in `dropped_attributes`); its links are checked then too;
- makes its events list on the first one added;
- hands itself to the processors when it ends: once ended, every setter refuses (as the SDK's do), so
  the span is its own read-only view and no copy is made.

Where every processor is a batch processor whose exporter is `Rebuilding` (as `shared.tracing_sdk` sets up
the span file, console and OTLP exporters), the tracer starts a `LiveSpan` (shared.tracing_live) instead:
its ids and times now, the calls made on it kept, and the `RecordedSpan` made from it (`rebuild`) on the
exporter's thread, off the event loop.

`RecordingTracer.start_span` is the SDK's, made cheaper where the answer is known: a sampled child of a
sampled parent is decided as `PeriodicSampler`'s shortcut decides it without building a `SamplingResult`;
the SDK's internal span metrics are skipped when they are the no-op ones (the default); processors whose
`on_start`/`_on_ending` are the SDK's empty ones are not called, and a `BatchSpanProcessor`'s queue is fed
directly (`ProcessorPlan`: what the SDK's `emit` does for a span it keeps, without its pid system call per
span; a full queue, a shut down processor or a forked child take the SDK's own path).

Everything else is the SDK's: sampler, ids, processors, resource, exporters (every exporter reads a
`RecordedSpan` as the `ReadableSpan` it is). `RecordingTracerProvider` hands out such tracers when the
installed SDK is the one this was checked against (`SDK_VERSION`) and no attribute length limit is set
(`OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT` and kin: then the SDK's path, which truncates); otherwise the SDK's
own tracer. tests/shared/test_tracing_record.py fails when the SDK internals this relies on change.
"""

from __future__ import annotations

import inspect
import os
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from time import time_ns
from types import MappingProxyType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace as trace_api
from opentelemetry.attributes import BoundedAttributes, _clean_attribute_value
from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
from opentelemetry.sdk.trace import (
    Event,
    ReadableSpan,
    Span,
    SpanLimits,
    SpanProcessor,
    SynchronousMultiSpanProcessor,
    Tracer,
    TracerProvider,
)
from opentelemetry.sdk.trace._tracer_metrics import NoOpTracerMetrics
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation import _SPAN_KEY
from opentelemetry.util import types

from shared import distversion
from shared.logs import get_logger
from shared.tracing_live import LiveSpan

# The SDK release whose Tracer.start_span, Span and ReadableSpan internals this module was written
# against (and the test pins, with their source); another release: the SDK's own tracer is used.
SDK_VERSION = "1.45.2"

_log = get_logger(__name__)
_PLAIN = frozenset((str, bool, int, float))  # attribute values kept as given (no cleaning needed)
_UNSET = Status(StatusCode.UNSET)
_NO_LINKS: tuple[trace_api.Link, ...] = ()
_NO_ATTRIBUTES: types.Attributes = MappingProxyType({})
_FLAGS = tuple(trace_api.TraceFlags(bits) for bits in range(4))  # sampled (0x01) x random trace id (0x02)
_SAMPLED = int(trace_api.TraceFlags.SAMPLED)
_RANDOM = int(trace_api.TraceFlags.RANDOM_TRACE_ID)
# Processor hooks that do nothing in the SDK (the test pins their source): not called per span.
_EMPTY_HOOKS = frozenset((SpanProcessor.on_start, SpanProcessor._on_ending, BatchSpanProcessor.on_start,
                          BatchSpanProcessor._on_ending, SimpleSpanProcessor.on_start, SimpleSpanProcessor._on_ending))
_pid = [os.getpid()]  # this process's pid, kept current across forks without a system call per span
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))
_getrandbits = random.getrandbits  # what RandomIdGenerator draws from
_DEFAULT_STATE = trace_api.DEFAULT_TRACE_STATE
_MAX_TRACE_ID = 2**128 - 1
_RECORD_AND_SAMPLE, _DROP = Decision.RECORD_AND_SAMPLE, Decision.DROP  # read per span: an enum member lookup less
# Every RecordedSpan's `_lock` (held only to check and set one span's fields; a span's first settling may run
# under it, never the reverse) and the lock a span's first settling holds (`RecordedSpan._settle`).
_SPAN_LOCK = threading.Lock()
_SETTLE_LOCK = threading.Lock()

# The current context, read and set through the API's context variable itself (the API's functions call
# the runtime context's, which call the variable's); another runtime context (OTEL_PYTHON_CONTEXT): the API's.
_current_context: Callable[[], otel_context.Context] = otel_context.get_current
_attach: Callable[[otel_context.Context], object] = otel_context.attach
_runtime = getattr(otel_context, "_RUNTIME_CONTEXT", None)
if type(_runtime) is ContextVarsRuntimeContext:
    _context_var = _runtime._current_context
    _current_context, _attach = _context_var.get, _context_var.set


def _detach(token: Any) -> None:
    """`otel_context.detach`: a token that cannot be reset is logged by the API, not raised."""
    if type(_runtime) is ContextVarsRuntimeContext:
        try:
            _context_var.reset(token)
            return
        except Exception:  # noqa: BLE001, S110 - the API's detach below logs it
            pass
    otel_context.detach(token)


def sdk_matches() -> bool:
    """Whether the installed SDK is the release this module was checked against."""
    try:
        return distversion.version("opentelemetry-sdk") == SDK_VERSION
    except distversion.PackageNotFoundError:
        return False


class RecordingTracerProvider(TracerProvider):
    """The SDK's provider, handing out `RecordingTracer`s where they record as the SDK would."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limits = self._span_limits
        self.fast = sdk_matches() and limits.max_span_attribute_length is None
        if not self.fast:
            _log.info("spans recorded by the SDK's own path", sdk=_installed(), checked=SDK_VERSION,
                      attribute_length_limit=limits.max_span_attribute_length)

    def get_tracer(self, instrumenting_module_name: str, instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: types.Attributes = None) -> trace_api.Tracer:
        tracer = super().get_tracer(instrumenting_module_name, instrumenting_library_version, schema_url, attributes)
        if self.fast and type(tracer) is Tracer:  # the SDK's (a disabled provider gives a NoOpTracer)
            tracer.__class__ = RecordingTracer  # same state, cached by the SDK; only how spans start differs
        return tracer


class RecordingTracer(Tracer):
    """The SDK's `Tracer`, starting `RecordedSpan`s (its `start_span`, with that one change), and making
    a span current with one small context manager (`CurrentSpan`) instead of the SDK's two nested
    generator-based ones (`start_as_current_span` around `use_span`)."""

    def start_as_current_span(  # type: ignore[override]
            self, name: str, context: otel_context.Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
            attributes: types.Attributes = None, links: Sequence[trace_api.Link] | None = (),
            start_time: int | None = None, record_exception: bool = True, set_status_on_exception: bool = True,
            end_on_exit: bool = True) -> CurrentSpan:
        return CurrentSpan(self, name, context, kind, attributes, links, start_time, record_exception,
                           set_status_on_exception, end_on_exit)

    def start_span(self, name: str, context: otel_context.Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: types.Attributes = None, links: Sequence[trace_api.Link] | None = (),
                   start_time: int | None = None, record_exception: bool = True,
                   set_status_on_exception: bool = True) -> trace_api.Span:
        # The SDK's start_span, in as few calls as it can be: a span context is read by index (trace id,
        # span id, is remote, flags, state, is valid), the spans we know by their field.
        found: Any = (_current_context() if context is None else context).get(_SPAN_KEY)
        setup = self._setup
        if setup is None or setup.sampler is not self.sampler or setup.plan.key is not getattr(
                self.span_processor, "_span_processors", None):
            setup = self._setup = TracerSetup(self)
        known = type(found)
        if known is LiveSpan or known is RecordedSpan or known is trace_api.NonRecordingSpan:
            current = found._context
        else:
            current = found.get_span_context() if isinstance(found, trace_api.Span) else trace_api.INVALID_SPAN_CONTEXT
            if current is not None and not isinstance(current, trace_api.SpanContext):
                raise TypeError("parent_span_context must be a SpanContext or None.")
        if not self._tracer_config.is_enabled:
            return trace_api.NonRecordingSpan(context=current)
        parent: trace_api.SpanContext | None
        sampled_attributes: types.Attributes
        trace_state: trace_api.TraceState | None
        if current is not None and current[5]:  # a valid parent
            parent, trace_id, bits = current, current[0], current[3] & _RANDOM
            # PeriodicSampler's shortcut: a sampled parent's child, sampled always
            always = bool(current[3] & _SAMPLED) and (setup.remote_sampled_on if current[2] else setup.local_sampled_on)
            state_if_always: trace_api.TraceState | None = current[4]
        else:
            parent = None
            if setup.random_ids:  # RandomIdGenerator's trace id, drawn here
                trace_id = _getrandbits(128)
                while not trace_id:
                    trace_id = _getrandbits(128)
                bits = _RANDOM
            else:
                trace_id = self.id_generator.generate_trace_id()
                bits = _RANDOM if self.id_generator.is_trace_id_random() else 0
            # PeriodicSampler's base for a root that is not PERIODIC: parent-based with an ALWAYS_ON root (the default)
            always = setup.root_sampled_on and not (attributes and setup.periodic_key in attributes)
            state_if_always = None
        if always:  # the sampler's answer, without its result object
            decision, sampled_attributes, trace_state = _RECORD_AND_SAMPLE, attributes, state_if_always
        else:
            sampling = self.sampler.should_sample(context, trace_id, name, kind, attributes, links or _NO_LINKS)
            decision, sampled_attributes, trace_state = sampling.decision, sampling.attributes, sampling.trace_state
        if decision is _RECORD_AND_SAMPLE:
            bits |= _SAMPLED
        if setup.random_ids:  # RandomIdGenerator's span id, drawn here; valid ids: the tuple the API would make
            span_id = _getrandbits(64)
            while not span_id:
                span_id = _getrandbits(64)
            span_context = tuple.__new__(trace_api.SpanContext, (
                trace_id, span_id, False, _FLAGS[bits], trace_state if trace_state is not None else _DEFAULT_STATE,
                0 < trace_id <= _MAX_TRACE_ID))
        else:
            span_context = trace_api.SpanContext(trace_id, self.id_generator.generate_span_id(), is_remote=False,
                                                 trace_flags=_FLAGS[bits], trace_state=trace_state)
        record_end_metrics = None if setup.no_metrics else self._tracer_metrics.start_span(parent, decision)
        if decision is _DROP:
            return trace_api.NonRecordingSpan(context=span_context)
        flags = None if record_exception and set_status_on_exception else (record_exception, set_status_on_exception)
        if record_end_metrics is None and setup.plan.rebuilding:  # no hook to call: a live span
            return LiveSpan(name, span_context, parent, setup, sampled_attributes, kind, links, start_time, flags)
        span = RecordedSpan(name, span_context, parent, setup, sampled_attributes, kind, links, start_time, flags)
        if record_end_metrics is not None:
            span._record_end_metrics = record_end_metrics
        for on_start in setup.plan.starts:
            on_start(span, parent_context=context)
        return span

    _setup: TracerSetup | None = None


class TracerSetup:
    """What a tracer's spans share, worked out once per sampler and set of processors: whether the sampler's
    shortcut applies, whether span ids are the SDK's random ones, whether the SDK's span metrics are the
    no-op ones, the processors' plan, and the fields every span of the tracer starts with."""

    def __init__(self, tracer: Tracer) -> None:
        self.sampler = tracer.sampler
        self.local_sampled_on = bool(getattr(self.sampler, "local_sampled_on", False))
        self.remote_sampled_on = bool(getattr(self.sampler, "remote_sampled_on", False))
        self.root_sampled_on = bool(getattr(self.sampler, "root_sampled_on", False))
        self.periodic_key: str = getattr(self.sampler, "periodic_key", "")
        self.random_ids = type(tracer.id_generator) is RandomIdGenerator
        self.no_metrics = type(tracer._tracer_metrics) is NoOpTracerMetrics
        self.plan = ProcessorPlan(tracer.span_processor)
        # the fields ReadableSpan.__init__ and Span.__init__ set that every span of the tracer shares: read
        # through the setup (RecordedSpan.__getattr__), not copied into each span
        self.shared: dict[str, Any] = {
            "_instrumentation_info": tracer.instrumentation_info, "_instrumentation_scope": tracer._instrumentation_scope,
            "_resource": tracer.resource, "_sampler": tracer.sampler, "_span_processor": tracer.span_processor,
            "_limits": tracer._span_limits}
        self.max_attributes: int | None = tracer._span_limits.max_span_attributes


class ProcessorPlan:
    """What a tracer's span processors need per span, worked out once per set of processors: the
    `on_start`/`_on_ending` hooks that do something, and each processor's `on_end`, where a
    `BatchSpanProcessor`'s is a direct append to its queue (`_batch_append`)."""

    def __init__(self, processor: Any) -> None:
        self.key = getattr(processor, "_span_processors", None)
        if type(processor) is SynchronousMultiSpanProcessor and self.key is not None:
            processors: Sequence[Any] = self.key
        else:  # another kind of multi-processor (e.g. concurrent): the SDK's calls, as they are
            processors = (processor,)
        self.starts = tuple(p.on_start for p in processors if type(p).on_start not in _EMPTY_HOOKS)
        self.endings = tuple(p._on_ending for p in processors if type(p)._on_ending not in _EMPTY_HOOKS)
        self.ends: tuple[Callable[[ReadableSpan], None], ...] = tuple(
            _batch_append(p) if type(p) is BatchSpanProcessor else p.on_end for p in processors)
        # every processor a batch one whose exporter rebuilds live spans: the shortcut may make LiveSpans
        self.rebuilding = bool(processors) and not self.starts and not self.endings and all(
            type(p) is BatchSpanProcessor and type(p._batch_processor._exporter) is Rebuilding for p in processors)


def _batch_append(processor: BatchSpanProcessor) -> Callable[[ReadableSpan], None]:
    """`processor.on_end` for a sampled span its queue has room for: the SDK's `BatchProcessor.emit` (queue the
    span, wake the worker once a batch is full) less its pid check; anything else through the SDK's own path."""
    batch = processor._batch_processor
    queue, pid = batch._queue, batch._pid
    room, batch_size, awaken = batch._max_queue_size, batch._max_export_batch_size, batch._worker_awaken

    def on_end(span: ReadableSpan) -> None:
        context = span._context
        if not (context and context[3] & _SAMPLED):  # its trace flags
            return
        if batch._shutdown or len(queue) >= room or pid != _pid[0] or batch._queue is not queue:
            processor.on_end(span)
            return
        queue.appendleft(span)
        if len(queue) >= batch_size and not awaken.is_set():
            awaken.set()
    return on_end


class CurrentSpan:
    """`with tracer.start_as_current_span(...) as span`: the span started on entry and made current; on
    exit the context restored, an escaping `Exception` recorded on the span and its status set (as
    `trace.use_span` does), the span ended. Also a decorator, as the SDK's is (sync and async)."""

    __slots__ = ("_args", "_flags", "_span", "_token", "_tracer")

    def __init__(self, tracer: Tracer, name: str, context: otel_context.Context | None, kind: SpanKind,
                 attributes: types.Attributes, links: Sequence[trace_api.Link] | None, start_time: int | None,
                 record_exception: bool, set_status_on_exception: bool, end_on_exit: bool) -> None:
        self._tracer = tracer
        self._args = (name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception)
        self._flags = (record_exception, set_status_on_exception, end_on_exit)
        self._span: trace_api.Span | None = None
        self._token: object = None

    def __enter__(self) -> trace_api.Span:
        span = self._span = self._tracer.start_span(*self._args)
        current = otel_context.Context(_current_context())  # `set_span_in_context`, one copy less
        dict.__setitem__(current, _SPAN_KEY, span)
        self._token = _attach(current)
        return span

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        span = self._span
        assert span is not None
        record_exception, set_status, end_on_exit = self._flags
        try:
            _detach(self._token)
            if isinstance(exc, Exception) and span.is_recording():
                if record_exception:
                    span.record_exception(exc)
                if set_status:
                    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        finally:
            if end_on_exit:
                span.end()

    def __call__(self, func: Any) -> Any:
        """As a decorator: each call in a fresh context manager with the same arguments."""
        import functools
        import inspect

        def fresh() -> CurrentSpan:
            return CurrentSpan(self._tracer, *self._args, self._flags[2])

        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with fresh():
                    return await func(*args, **kwargs)
            return run_async

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            with fresh():
                return func(*args, **kwargs)
        return run


class RecordedSpan(Span):
    """A recording span (module doc): the SDK's `Span` with plain attributes, stored when read, and no copy at
    its end."""

    # What every span starts with, on the class: a span sets its own field when it changes one.
    _status = _UNSET
    _events: Any = ()
    _end_time: int | None = None
    _dropped_attributes = 0
    _trace_config = None
    _record_exception = True
    _set_status_on_exception = True
    _record_end_metrics: Any = None
    _lock = _SPAN_LOCK
    # attribute mappings set and not yet stored, and links given at the start and not yet checked: both are
    # settled (`_settle`) when `_attributes` or `_links` is first read, by an exporter (on its own thread) or
    # by a reader of the live span
    _pending: list[Mapping[str, Any]] | None = None
    _given_links: Sequence[trace_api.Link] | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> RecordedSpan:
        return object.__new__(cls)  # the SDK's Span.__new__ only refuses to make a bare `Span`

    def __init__(self, name: str, context: trace_api.SpanContext, parent: trace_api.SpanContext | None,
                 setup: TracerSetup, attributes: types.Attributes, kind: SpanKind,
                 links: Sequence[trace_api.Link] | None, start_time: int | None,
                 flags: tuple[bool, bool] | None = None) -> None:
        # the fields that differ from span to span; the rest are the class's or the setup's (`__getattr__`)
        self._name = name
        self._context = context
        self._kind = kind
        self._parent = parent
        self._setup = setup
        if attributes:
            self._pending = [dict(attributes)]  # a copy, as the SDK's own: the caller may change its mapping
        if links:
            self._given_links = links
        self._start_time = start_time if start_time is not None else time_ns()
        if flags is not None:  # (record_exception, set_status_on_exception) where not both True
            self._record_exception, self._set_status_on_exception = flags

    def __getattr__(self, name: str) -> Any:
        """The fields not set on the span: the tracer's shared ones, and the settled attributes and links."""
        if name == "_attributes" or name == "_links":
            self._settle()
            return self.__dict__[name]
        if name != "_setup":
            try:
                return self._setup.shared[name]
            except KeyError:
                pass
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _settle(self) -> None:
        """Store the pending attributes (the SDK's limits and cleaning, `_put`) and check the given links (the
        SDK's `_new_links`), once; a reader on another thread (an exporter) waits for the first to finish."""
        with _SETTLE_LOCK:
            fields = self.__dict__
            if "_attributes" not in fields:
                fields["_attributes"] = {}
            pending = fields.pop("_pending", None)
            if pending:
                for attributes in pending:
                    self._put(attributes)
            if "_links" not in fields:
                given = fields.pop("_given_links", None)
                fields["_links"] = self._new_links(given) if given else _NO_LINKS

    def _put(self, attributes: Mapping[str, Any]) -> None:
        """Store attributes (the caller holds the lock or owns the span): module doc."""
        store = self.__dict__["_attributes"]
        limit = self._setup.max_attributes
        for key, value in attributes.items():
            if type(key) is not str or not key:
                _log.warning("span attribute dropped: its key must be a non-empty string", key=repr(key))
                self._dropped_attributes += 1
                continue
            kind = type(value)
            if kind not in _PLAIN:
                if (kind is tuple or kind is list) and all(type(v) is str for v in value):
                    value = tuple(value)  # as the SDK's cleaning makes a sequence of str
                else:
                    value = _clean_attribute_value(value, None)
            if key in store:
                del store[key]
            elif limit is not None and len(store) >= limit:
                if limit == 0:
                    self._dropped_attributes += 1
                    continue
                del store[next(iter(store))]
                self._dropped_attributes += 1
            store[key] = value

    @property
    def dropped_attributes(self) -> int:
        if "_attributes" not in self.__dict__:
            self._settle()
        return self._dropped_attributes

    def set_attributes(self, attributes: Mapping[str, types.AnyValue]) -> None:
        with self._lock:
            if self._end_time is not None:
                _log.warning("attribute not set: the span has ended", span=self._name)
                return
            if "_attributes" in self.__dict__:  # settled already (read while live): stored now
                self._put(attributes)
            elif self._pending is None:
                self._pending = [dict(attributes)]
            else:
                self._pending.append(dict(attributes))

    def set_attribute(self, key: str, value: types.AnyValue) -> None:
        self.set_attributes({key: value})

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        """The SDK's `add_event`; plain attributes within the event limit are kept in a read-only view of a
        copy instead of a `BoundedAttributes` (its lock and re-validation of every value)."""
        limit = self._limits.max_event_attributes
        kept: types.Attributes
        if not attributes:
            kept = _NO_ATTRIBUTES
        elif (limit is None or len(attributes) <= limit) and all(
                type(key) is str and key and type(value) in _PLAIN for key, value in attributes.items()):
            kept = MappingProxyType(dict(attributes))
        else:
            kept = BoundedAttributes(limit, attributes, max_value_len=self._limits.max_attribute_length, immutable=True)
        self._add_event(Event(name=name, attributes=kept, timestamp=timestamp))

    def _add_event(self, event: Any) -> None:
        with self._lock:
            if self._end_time is not None:
                _log.warning("event not added: the span has ended", span=self._name)
                return
            if not isinstance(self._events, BoundedList):
                self._events = BoundedList(self._limits.max_events)
            self._events.append(event)

    def _add_link(self, link: trace_api.Link) -> None:
        with self._lock:
            if self._end_time is not None:
                _log.warning("link not added: the span has ended", span=self._name)
                return
            if not isinstance(self._links, BoundedList):
                self._links = BoundedList.from_seq(self._limits.max_links, self._links)
            self._links.append(link)

    def end(self, end_time: int | None = None) -> None:
        with self._lock:
            if self._start_time is None:
                raise RuntimeError("Calling end() on a not started span.")
            if self._end_time is not None:
                _log.warning("span ended twice: the second end is ignored", span=self._name)
                return
            self._end_time = end_time if end_time is not None else time_ns()
        if self._record_end_metrics is not None:
            self._record_end_metrics()
        plan = self._setup.plan
        for ending in plan.endings:
            ending(self)
        for on_end in plan.ends:
            on_end(self)  # ended: every setter refuses, so the span is its own read-only view


def rebuild(live: LiveSpan) -> RecordedSpan:
    """The SDK's span for a live one (shared.tracing_live): the same ids, kind and times, its calls made again in
    order on a `RecordedSpan`, so the SDK's limits, cleaning and status rules apply as they would have."""
    span = RecordedSpan(live._name, live._context, live._parent, live._setup, live._pending, live._kind,
                        live._links, live._start_time, live._flags)
    for method, args in live._calls or ():
        getattr(span, method)(*args)
    span._end_time = live._end_time
    return span


def plain_fields(live: LiveSpan) -> tuple[dict[str, Any], list[trace_api.SpanContext], StatusCode] | None:
    """The attributes, link contexts and status code the SDK's span for `live` (`rebuild`) would hold, read from the
    live span directly where they are plain to see: every attribute key a non-empty `str` and every value a `str`,
    `bool`, `int` or `float` (or a list or tuple of `str`), no more attributes or links than the limits, every link
    to a valid span context. None where they are not: then only the rebuilt span says. Events are not read."""
    calls = live._calls
    attributes = dict(live._pending) if live._pending else {}
    given = live._links
    links = [link.context for link in given] if given else []
    code = StatusCode.UNSET
    if calls:
        for method, args in calls:
            if method == "set_attributes":
                for key, value in args[0].items():  # a key set again goes last, as the SDK's store puts it
                    attributes.pop(key, None)
                    attributes[key] = value
            elif method == "set_status":
                status, _ = args
                asked = status.status_code if isinstance(status, Status) else status
                if not isinstance(asked, StatusCode):
                    return None
                if code is not StatusCode.OK and asked is not StatusCode.UNSET:  # the SDK's set_status rule
                    code = asked
            elif method == "add_link":
                links.append(args[0])
            elif method != "add_event":
                return None
    limits: SpanLimits = live._setup.shared["_limits"]
    if (limits.max_span_attributes is not None and len(attributes) > limits.max_span_attributes) or (
            limits.max_links is not None and len(links) > limits.max_links):
        return None
    for key, value in attributes.items():
        kind = type(value)
        if type(key) is not str or not key or (kind not in _PLAIN and not (
                (kind is list or kind is tuple) and all(type(v) is str for v in value))):  # type: ignore[union-attr]
            return None
    for context in links:
        if not (context and context[5]):
            return None
    return attributes, links, code


class Rebuilding(SpanExporter):
    """An exporter behind a batch processor, handed the SDK's span for each live one (`rebuild`, on the
    processor's thread): where every processor's exporter is one, spans are made live (shared.tracing_live)."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter
        # an exporter that reads live spans itself (the span file: `plain_fields`, else `rebuild`) gets them as they are
        self.passes_live = bool(getattr(exporter, "reads_live_spans", False))

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        if self.passes_live:
            return self.exporter.export(spans)
        return self.exporter.export([s.rebuilt(rebuild) if type(s) is LiveSpan else s for s in spans])

    def shutdown(self, timeout_millis: float | None = None) -> None:
        close = self.exporter.shutdown
        if timeout_millis is not None and "timeout_millis" in inspect.getfullargspec(close).args:
            close(timeout_millis=timeout_millis)  # type: ignore[call-arg]
        else:
            close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


def _installed() -> str:
    try:
        return distversion.version("opentelemetry-sdk")
    except distversion.PackageNotFoundError:
        return "none"
