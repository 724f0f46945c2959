"""The cheaper span recording path (shared/tracing_record.py): the spans it records are the SDK's spans
(what every exporter reads: the OTLP encoding, the span file), and the SDK internals it relies on are the
ones it was written against: a new SDK release fails here, loudly, until the module is reviewed."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import inspect
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace as api
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk import trace as sdk
from opentelemetry.sdk._shared_internal import BatchProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace import sampling as sdk_sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, DEFAULT_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared import tracing_record
from shared.telemetry import (
    NoOpCurrentSpan,
    current_traceparent,
    extract_context,
    extract_grpc_context,
    inject_grpc_metadata,
    inject_headers,
    leaf_span,
    span_link,
    traceparent_context,
)
from shared.tracing_live import LiveSpan
from shared.tracing_record import Rebuilding, RecordedSpan, RecordingTracer, RecordingTracerProvider
from shared.tracing_sdk import JsonLinesSpanExporter, PeriodicSampler, span_to_dict

# The SDK and API code shared/tracing_record.py (and PeriodicSampler's shortcut) mirror or rely on, as
# sha256 of its source (first 12 hex digits) in SDK_VERSION. A change: read the new code, bring the module
# in line, then update SDK_VERSION and these.
PINNED = {
    "Tracer.start_span": (lambda: sdk.Tracer.start_span, "3cd55e4a9e14"),
    "Tracer.start_as_current_span": (lambda: sdk.Tracer.start_as_current_span, "5923e42ec4d5"),
    "use_span": (lambda: api.use_span, "51a3cc4f931b"),
    "ReadableSpan.__init__": (lambda: sdk.ReadableSpan.__init__, "9fd2a50ea354"),
    "Span.__init__": (lambda: sdk.Span.__init__, "5687a97d122b"),
    "Span.end": (lambda: sdk.Span.end, "88aca2e904b8"),
    "Span.set_attribute": (lambda: sdk.Span.set_attribute, "1ed35e3cad63"),
    "Span.set_attributes": (lambda: sdk.Span.set_attributes, "7973a9fb0ed8"),
    "_check_span_ended": (lambda: sdk._check_span_ended, "976817f357e8"),
    "Span._new_links": (lambda: sdk.Span._new_links, "31b972f901f5"),
    "TracerProvider.__init__": (lambda: sdk.TracerProvider.__init__, "c3fff9449af0"),
    "TracerProvider.get_tracer": (lambda: sdk.TracerProvider.get_tracer, "fb1baaf470c3"),
    "Tracer.__init__": (lambda: sdk.Tracer.__init__, "e36fad4782c4"),
    "ProxyTracer._tracer": (lambda: api.ProxyTracer._tracer.fget, "ef7c3805b342"),  # type: ignore[attr-defined]
    "ProxyTracer.start_as_current_span": (lambda: api.ProxyTracer.start_as_current_span, "9d69bb17c36f"),
    "ParentBased.should_sample": (lambda: sdk_sampling.ParentBased.should_sample, "2f4e7c936dc7"),
    "StaticSampler.should_sample": (lambda: sdk_sampling.StaticSampler.should_sample, "45cb9cd55e66"),
    "BoundedAttributes.__setitem__": (lambda: BoundedAttributes.__setitem__, "cd162b67001b"),
    "Span.start": (lambda: sdk.Span.start, "42c19e6de8fe"),
    "Span.add_event": (lambda: sdk.Span.add_event, "6503d7d05c95"),
    "SynchronousMultiSpanProcessor.on_start": (lambda: sdk.SynchronousMultiSpanProcessor.on_start, "f43bc98c976e"),
    "SynchronousMultiSpanProcessor._on_ending": (lambda: sdk.SynchronousMultiSpanProcessor._on_ending, "4f4a867164a5"),
    "SynchronousMultiSpanProcessor.on_end": (lambda: sdk.SynchronousMultiSpanProcessor.on_end, "3320b74a9dd2"),
    "SpanProcessor.on_start": (lambda: sdk.SpanProcessor.on_start, "fb6462840c6f"),
    "SpanProcessor._on_ending": (lambda: sdk.SpanProcessor._on_ending, "316f2c1993a5"),
    "BatchSpanProcessor.on_start": (lambda: BatchSpanProcessor.on_start, "d32fb0685257"),
    "BatchSpanProcessor._on_ending": (lambda: BatchSpanProcessor._on_ending, "60edc5c9cc95"),
    "BatchSpanProcessor.on_end": (lambda: BatchSpanProcessor.on_end, "0f0a7d0eb4f9"),
    "SimpleSpanProcessor.on_start": (lambda: SimpleSpanProcessor.on_start, "d32fb0685257"),
    "SimpleSpanProcessor._on_ending": (lambda: SimpleSpanProcessor._on_ending, "60edc5c9cc95"),
    "BatchProcessor.emit": (lambda: BatchProcessor.emit, "221acffa5dba"),
    "BatchProcessor._at_fork_reinit": (lambda: BatchProcessor._at_fork_reinit, "714be2db71b5"),
    # shared.telemetry's W3C fast paths read and write as these do
    "TraceContextTextMapPropagator.extract": (lambda: TraceContextTextMapPropagator.extract, "bc8961017b0c"),
    "TraceContextTextMapPropagator.inject": (lambda: TraceContextTextMapPropagator.inject, "e658544249b1"),
    "set_span_in_context": (lambda: api.set_span_in_context, "f75057fa9ada"),
    "get_current_span": (lambda: api.get_current_span, "e067c8d76726"),
    # RecordingTracer.start_span reads and makes these itself (by field, by index)
    "Tracer._is_enabled": (lambda: sdk.Tracer._is_enabled, "4204374b0613"),
    "NonRecordingSpan.__init__": (lambda: api.NonRecordingSpan.__init__, "2beaa35e497c"),
    "SpanContext.__new__": (lambda: api.SpanContext.__new__, "ba12f8f39fd1"),
    "RandomIdGenerator.generate_span_id": (lambda: RandomIdGenerator.generate_span_id, "62e00c74bd22"),
    "RandomIdGenerator.generate_trace_id": (lambda: RandomIdGenerator.generate_trace_id, "ad02e8aa1c9f"),
    "ContextVarsRuntimeContext.attach": (lambda: ContextVarsRuntimeContext.attach, "a8df009b4ec0"),
    "ContextVarsRuntimeContext.detach": (lambda: ContextVarsRuntimeContext.detach, "d7c28d514dfc"),
    "ContextVarsRuntimeContext.get_current": (lambda: ContextVarsRuntimeContext.get_current, "bba8ecec2567"),
    "context.detach": (lambda: otel_context.detach, "ea3a3066c62f"),
    # NoOpCurrentSpan does what these do
    "NoOpTracer.start_span": (lambda: api.NoOpTracer.start_span, "c2d6354c65a8"),
    "NoOpTracer.start_as_current_span": (lambda: api.NoOpTracer.start_as_current_span, "ac0a0cf6c991"),
}


def source_hash(get: Callable[[], Any]) -> str:
    return hashlib.sha256(inspect.getsource(get()).encode()).hexdigest()[:12]


def test_the_sdk_is_the_release_and_code_the_recording_path_was_checked_against() -> None:
    installed = importlib.metadata.version("opentelemetry-sdk")
    changed = {name: source_hash(get) for name, (get, pinned) in PINNED.items()
               if pinned is not None and source_hash(get) != pinned}
    assert installed == tracing_record.SDK_VERSION and not changed, (
        f"opentelemetry-sdk {installed} (shared/tracing_record.py was checked against {tracing_record.SDK_VERSION}); "
        f"changed SDK code: {changed}. Review shared/tracing_record.py against it, then update SDK_VERSION and PINNED")
    assert tracing_record.sdk_matches()


Pair = tuple[TracerProvider, InMemorySpanExporter]


def provider(kind: type[TracerProvider], **kwargs: Any) -> Pair:
    made = kind(resource=Resource.create({"service.name": "t", "k8s.node.name": "n1"}), **kwargs)
    memory = InMemorySpanExporter()
    made.add_span_processor(SimpleSpanProcessor(memory))
    return made, memory


@pytest.fixture
def pair() -> Iterator[tuple[Pair, Pair]]:
    made = provider(TracerProvider), provider(RecordingTracerProvider)
    yield made
    for p, _ in made:
        p.shutdown()


class Odd:
    def __str__(self) -> str:
        return "odd"


def workload(tracer: api.Tracer) -> None:
    """What our code does with spans, and what other code might: typed and untyped attribute values, a bad
    key, events, links, a failure, a leaf span, attributes after the end."""
    parent = traceparent_context("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    link = api.get_current_span(traceparent_context("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"))
    with tracer.start_as_current_span("rpc", context=parent, kind=SpanKind.SERVER,
                                      attributes={"rpc.method": "Prepare", "dra.claims": 2, "ok": True, "f": 1.5},
                                      links=[api.Link(link.get_span_context())]) as rpc:
        untyped: dict[str, Any] = {"dra.device": ["gpu-0", "gpu-1"], "gpu.uuid": ("GPU-1",), "odd": Odd(),
                                   "": "no key", "n": None}
        rpc.set_attributes(untyped)
        rpc.set_attribute("dra.claims", 3)
        rpc.add_event("claim.get", {"dra.claim.get_ms": 0.4})
        rpc.add_link(link.get_span_context(), {"why": "later"})
        with leaf_span(tracer, "checkpoint.write", {"checkpoint.events": 1}):
            pass
        with pytest.raises(ValueError), tracer.start_as_current_span("claim.prepare"):
            raise ValueError("no such device")
    rpc.set_attribute("late", 1)
    rpc.end()


def comparable(span: ReadableSpan) -> dict[str, Any]:
    """A span's exported content without its ids and times."""
    return {"name": span.name, "kind": span.kind, "parent": bool(span.parent), "remote": span.parent and span.parent.is_remote,
            "attributes": dict(span.attributes or {}), "dropped": span.dropped_attributes,
            "events": [(e.name, e.attributes["exception.type"] if e.name == "exception" else dict(e.attributes))
                       for e in span.events if e.attributes is not None],
            "links": [(link.context.span_id, dict(link.attributes or {})) for link in span.links],
            "status": (span.status.status_code, span.status.description), "resource": dict(span.resource.attributes),
            "scope": span.instrumentation_scope, "dropped_events": span.dropped_events, "dropped_links": span.dropped_links}


_STRIP = [("trace_id", b""), ("span_id", b""), ("parent_span_id", b""), ("start_time_unix_nano", 0),
         ("end_time_unix_nano", 0)]


def encoded(spans: Sequence[ReadableSpan]) -> list[Any]:
    """The OTLP encoding of spans (both OTLP exporters send it) without their ids and times."""
    out = []
    for resource in encode_spans(spans).resource_spans:
        for scope in resource.scope_spans:
            for span in scope.spans:
                for field, empty in _STRIP:
                    setattr(span, field, empty)
                for item in [*span.events, *span.links]:
                    for field in ("time_unix_nano", "span_id", "trace_id"):
                        if hasattr(item, field):
                            setattr(item, field, 0 if field == "time_unix_nano" else b"")
                for event in span.events:  # a stack trace names the frames it went through
                    kept = [kv for kv in event.attributes if kv.key != "exception.stacktrace"]
                    del event.attributes[:]
                    event.attributes.extend(kept)
                out.append(span.SerializeToString(deterministic=True))
    return out


def test_recorded_spans_are_the_sdks_spans_to_every_exporter(pair: tuple[Pair, Pair],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    (stock, stock_spans), (ours, our_spans) = pair
    assert type(ours.get_tracer("t")) is RecordingTracer
    with caplog.at_level(logging.WARNING):
        workload(stock.get_tracer("t"))
        workload(ours.get_tracer("t"))
    theirs, mine = stock_spans.get_finished_spans(), our_spans.get_finished_spans()
    assert all(type(s) is RecordedSpan for s in mine) and len(mine) == len(theirs) == 3
    assert [comparable(s) for s in mine] == [comparable(s) for s in theirs]
    rpc = dict(mine[-1].attributes or {})
    assert rpc["dra.device"] == ("gpu-0", "gpu-1") and rpc["odd"] == "odd"
    assert rpc["dra.claims"] == 3 and "late" not in rpc
    assert mine[1].status.status_code is StatusCode.ERROR
    # the OTLP encoding (both OTLP exporters) and the span file read them alike
    assert encoded(mine) == encoded(theirs)
    drop = ("trace_id", "span_id", "parent_span_id", "start_ns", "end_ns", "links")
    assert [{k: v for k, v in span_to_dict(s).items() if k not in drop} for s in mine] == \
           [{k: v for k, v in span_to_dict(s).items() if k not in drop} for s in theirs]


def test_the_attribute_count_limit_holds_as_in_the_sdk() -> None:
    limits = SpanLimits(max_span_attributes=2)
    (stock, stock_spans), (ours, our_spans) = provider(TracerProvider, span_limits=limits), \
        provider(RecordingTracerProvider, span_limits=limits)
    for p in (stock, ours):
        with p.get_tracer("t").start_as_current_span("s", attributes={"a": 1, "b": 2, "c": 3}) as span:
            span.set_attribute("d", 4)
            span.set_attribute("c", 5)
    theirs, mine = stock_spans.get_finished_spans()[0], our_spans.get_finished_spans()[0]
    assert type(mine) is RecordedSpan
    assert dict(mine.attributes or {}) == dict(theirs.attributes or {}) == {"d": 4, "c": 5}
    assert mine.dropped_attributes == theirs.dropped_attributes


def test_an_attribute_length_limit_keeps_the_sdks_own_path() -> None:
    ours, memory = provider(RecordingTracerProvider, span_limits=SpanLimits(max_span_attribute_length=3))
    assert isinstance(ours, RecordingTracerProvider) and not ours.fast and type(ours.get_tracer("t")) is sdk.Tracer
    with ours.get_tracer("t").start_as_current_span("s", attributes={"a": "abcdef"}):
        pass
    assert memory.get_finished_spans()[0].attributes == {"a": "abc"}


def test_a_recorded_span_has_every_field_the_sdk_span_has(pair: tuple[Pair, Pair]) -> None:
    (stock, _), (ours, _) = pair
    tracer = ours.get_tracer("t")
    theirs, mine = stock.get_tracer("t").start_span("s"), tracer.start_span("s")
    # each is the span's own, the class's (what every span starts with) or the tracer's (read through its setup)
    assert [name for name in vars(theirs) if not hasattr(mine, name)] == []
    assert isinstance(tracer, sdk.Tracer) and isinstance(mine, RecordedSpan)
    assert (mine._resource, mine._instrumentation_scope, mine._limits, mine._span_processor) == (
        tracer.resource, tracer._instrumentation_scope, tracer._span_limits, tracer.span_processor)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        mine.nothing  # noqa: B018
    for span in (theirs, mine):
        span.end()


@pytest.mark.parametrize("base", [DEFAULT_ON, ParentBased(TraceIdRatioBased(0.5)), ParentBased(ALWAYS_OFF),
                                  ParentBased(ALWAYS_ON, remote_parent_sampled=ALWAYS_OFF), TraceIdRatioBased(0.5)])
def test_the_periodic_samplers_shortcut_decides_as_its_base(base: sdk_sampling.Sampler) -> None:
    sampler = PeriodicSampler(base, 0.0)
    local = api.NonRecordingSpan(api.SpanContext(1, 2, False, api.TraceFlags(api.TraceFlags.SAMPLED)))
    parents = [traceparent_context("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
               traceparent_context("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"),
               api.set_span_in_context(local), None]
    for parent in parents:
        for trace_id in (1, 2**127):
            got = sampler.should_sample(parent, trace_id, "s", attributes={"a": 1})
            want = base.should_sample(parent, trace_id, "s", attributes={"a": 1})
            assert (got.decision, dict(got.attributes), got.trace_state) == \
                   (want.decision, dict(want.attributes), want.trace_state)


def test_start_as_current_span_decorates_functions_and_coroutines_as_the_sdks_does(pair: tuple[Pair, Pair]) -> None:
    _, (ours, memory) = pair
    tracer = ours.get_tracer("t")

    @tracer.start_as_current_span("sync")
    def sync() -> int:
        return api.get_current_span().get_span_context().span_id

    @tracer.start_as_current_span("async")
    async def run() -> int:
        return api.get_current_span().get_span_context().span_id

    ids = [sync(), sync(), asyncio.run(run())]
    spans = memory.get_finished_spans()
    assert [s.name for s in spans] == ["sync", "sync", "async"]
    assert ids == [s.context.span_id for s in spans] and len(set(ids)) == 3
    assert not api.get_current_span().get_span_context().is_valid  # each call's context restored


def test_a_batch_processor_gets_recorded_spans_as_the_sdks_own_path_gives_them(
        caplog: pytest.LogCaptureFixture) -> None:
    """Spans are queued straight onto a BatchSpanProcessor's queue (ProcessorPlan): exported alike, and
    what the SDK's `emit` does besides queueing (a full queue, a shut-down processor, a forked child) is
    still its own."""
    made = []
    for kind in (TracerProvider, RecordingTracerProvider):
        p = kind(resource=Resource.create({"service.name": "t"}))
        memory = InMemorySpanExporter()
        p.add_span_processor(BatchSpanProcessor(memory, schedule_delay_millis=60_000))
        made.append((p, memory))
    (stock, stock_spans), (ours, our_spans) = made
    with caplog.at_level(logging.WARNING):
        workload(stock.get_tracer("t"))
        workload(ours.get_tracer("t"))
    for p in (stock, ours):
        assert p.force_flush()
    assert [comparable(s) for s in our_spans.get_finished_spans()] == \
           [comparable(s) for s in stock_spans.get_finished_spans()]
    assert all(type(s) is RecordedSpan for s in our_spans.get_finished_spans())
    # a full queue: dropped with the SDK's warning, as the SDK drops
    small = RecordingTracerProvider()
    kept = InMemorySpanExporter()
    small.add_span_processor(BatchSpanProcessor(kept, max_queue_size=2, max_export_batch_size=2,
                                                schedule_delay_millis=60_000))
    with caplog.at_level(logging.WARNING):
        for name in ("a", "b", "c"):
            small.get_tracer("t").start_span(name).end()
    assert any("Queue full" in r.getMessage() for r in caplog.records)
    small.force_flush()
    assert len(kept.get_finished_spans()) == 2
    # a processor whose worker belongs to another process (a fork): the SDK re-creates it, then queues
    forked = RecordingTracerProvider()
    exported = InMemorySpanExporter()
    processor = BatchSpanProcessor(exported, schedule_delay_millis=60_000)
    forked.add_span_processor(processor)
    processor._batch_processor._pid = -1
    forked.get_tracer("t").start_span("after-fork").end()
    assert processor._batch_processor._pid != -1
    forked.get_tracer("t").start_span("then").end()
    forked.force_flush()
    assert [s.name for s in exported.get_finished_spans()] == ["after-fork", "then"]
    # shut down: nothing queued any more
    processor.shutdown()
    forked.get_tracer("t").start_span("late").end()
    assert [s.name for s in exported.get_finished_spans()] == ["after-fork", "then"]
    for p in (stock, ours, small):
        p.shutdown()


def test_live_spans_rebuilt_for_the_exporter_are_the_sdks_spans(caplog: pytest.LogCaptureFixture) -> None:
    """Where every processor is a batch one whose exporter rebuilds spans (`Rebuilding`, as `build_provider`
    sets up the span file and OTLP), the tracer makes `LiveSpan`s: the calls made on them are made again on
    the SDK's span on the exporter's thread, and what the exporter gets is what the SDK's own path gives."""
    (stock, stock_spans) = provider(TracerProvider)
    ours = RecordingTracerProvider(resource=Resource.create({"service.name": "t", "k8s.node.name": "n1"}))
    our_spans = InMemorySpanExporter()
    ours.add_span_processor(BatchSpanProcessor(Rebuilding(our_spans), schedule_delay_millis=60_000))
    tracer = ours.get_tracer("t")
    made: list[type] = []
    with tracer.start_as_current_span("outer") as outer, leaf_span(tracer, "leaf") as leaf:
        made += [type(outer), type(leaf)]
        assert outer.is_recording() and leaf.get_span_context().trace_id == outer.get_span_context().trace_id
        assert current_traceparent().split("-")[2] == f"{outer.get_span_context().span_id:016x}"
    assert made == [LiveSpan, LiveSpan] and not outer.is_recording()
    with caplog.at_level(logging.WARNING):
        workload(stock.get_tracer("t"))
        workload(tracer)
    assert any("it has ended" in r.getMessage() or "ended twice" in r.getMessage() for r in caplog.records)
    assert ours.force_flush()
    theirs, mine = stock_spans.get_finished_spans(), our_spans.get_finished_spans()[2:]
    assert all(type(s) is RecordedSpan for s in mine) and len(mine) == len(theirs) == 3
    assert [comparable(s) for s in mine] == [comparable(s) for s in theirs]
    assert encoded(mine) == encoded(theirs)  # what both OTLP exporters send
    assert [(s.start_time is not None and s.end_time is not None and s.start_time <= s.end_time) for s in mine] == [True] * 3
    exception = next(e for e in mine[1].events if e.name == "exception")
    assert exception.attributes is not None and exception.attributes["exception.type"] == "ValueError"
    assert "no such device" in str(exception.attributes["exception.stacktrace"])
    # the span file reads a rebuilt span as it reads the SDK's
    drop = ("trace_id", "span_id", "parent_span_id", "start_ns", "end_ns", "links")
    assert [{k: v for k, v in span_to_dict(s).items() if k not in drop} for s in mine] == \
           [{k: v for k, v in span_to_dict(s).items() if k not in drop} for s in theirs]
    # the attribute count limit, on the exporter's thread as on the loop
    limited = RecordingTracerProvider(span_limits=SpanLimits(max_span_attributes=2))
    limited_spans = InMemorySpanExporter()
    limited.add_span_processor(BatchSpanProcessor(Rebuilding(limited_spans), schedule_delay_millis=60_000))
    with limited.get_tracer("t").start_as_current_span("s", attributes={"a": 1, "b": 2, "c": 3}) as span:
        assert type(span) is LiveSpan
        span.set_attribute("d", 4)
        span.set_attribute("c", 5)
    limited.force_flush()
    assert dict(limited_spans.get_finished_spans()[0].attributes or {}) == {"d": 4, "c": 5}
    assert limited_spans.get_finished_spans()[0].dropped_attributes == 2  # a, then b (the SDK drops the same)
    # a processor added that does not rebuild: recorded spans again, for every processor
    ours.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    with tracer.start_as_current_span("after") as after:
        assert type(after) is RecordedSpan
    for p in (stock, ours, limited):
        p.shutdown()


def statuses_and_links(tracer: api.Tracer) -> None:
    """The status rules (OK holds; UNSET changes nothing; a code with its description) and links the span file
    reads from a live span itself, and links it leaves to the SDK (to an invalid context, kept for its attributes)."""
    remote = api.get_current_span(traceparent_context("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"))
    with tracer.start_as_current_span("ok-holds") as span:
        span.set_status(api.Status(StatusCode.OK))
        span.set_status(api.Status(StatusCode.ERROR, "too late"))
    with tracer.start_as_current_span("code-and-text") as span:
        span.set_status(StatusCode.ERROR, "no such device")
        span.set_status(api.Status(StatusCode.UNSET))
        span.set_attribute("dra.claim.uid", "u1")
        span.set_attributes({"a": 1, "dra.claim.uid": "u2"})
    with tracer.start_as_current_span("linked", links=[api.Link(remote.get_span_context())]) as span:
        span.add_link(remote.get_span_context())
    with tracer.start_as_current_span("invalid-link", links=[api.Link(api.INVALID_SPAN_CONTEXT, {"why": "x"})]):
        pass


def test_the_span_file_reads_live_spans_as_the_sdks_spans(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """`JsonLinesSpanExporter` behind `Rebuilding` reads live spans itself where their fields are plain
    (`plain_fields`), and from the rebuilt span where not (a value to clean, a bad key, an invalid link):
    every line is the one the SDK's own span gives."""
    (stock, stock_spans) = provider(TracerProvider)
    ours = RecordingTracerProvider(resource=Resource.create({"service.name": "t", "k8s.node.name": "n1"}))
    path = tmp_path / "spans.jsonl"
    ours.add_span_processor(BatchSpanProcessor(Rebuilding(JsonLinesSpanExporter(str(path))),
                                               schedule_delay_millis=60_000))
    with caplog.at_level(logging.WARNING):
        for work in (workload, statuses_and_links):
            work(stock.get_tracer("t"))
            work(ours.get_tracer("t"))
    assert ours.force_flush()
    remote = {"00f067aa0ba902b7", "0000000000000000"}

    def comparable_line(line: dict[str, Any]) -> dict[str, Any]:
        kept = {k: v for k, v in line.items() if k not in ("trace_id", "span_id", "parent_span_id", "start_ns",
                                                            "end_ns", "links")}
        kept["links"] = [link["span_id"] if link["span_id"] in remote else "local" for link in line["links"]]
        kept["parent"] = bool(line["parent_span_id"])
        return kept

    mine = [json.loads(line) for line in path.read_text().splitlines()]
    theirs = [msgspec.json.decode(msgspec.json.encode(span_to_dict(s), enc_hook=str)) for s in stock_spans.get_finished_spans()]
    assert len(mine) == len(theirs) == 7
    assert [comparable_line(m) for m in mine] == [comparable_line(t) for t in theirs]
    by_name = {m["name"]: m for m in mine}
    assert by_name["ok-holds"]["status"] == "OK" and by_name["code-and-text"]["status"] == "ERROR"
    assert by_name["code-and-text"]["attributes"] == {"dra.claim.uid": "u2", "a": 1}
    assert len(by_name["invalid-link"]["links"]) == 1 and len(by_name["linked"]["links"]) == 2
    for p in (stock, ours):
        p.shutdown()


def test_processors_added_later_and_processors_with_hooks_are_called() -> None:
    calls: list[str] = []

    class Hooks(sdk.SpanProcessor):
        def on_start(self, span: sdk.Span, parent_context: Any = None) -> None:
            calls.append(f"start {span.name}")

        def _on_ending(self, span: sdk.Span) -> None:
            calls.append(f"ending {span.name}")

        def on_end(self, span: ReadableSpan) -> None:
            calls.append(f"end {span.name}")

    ours, memory = provider(RecordingTracerProvider)
    tracer = ours.get_tracer("t")
    tracer.start_span("first").end()
    ours.add_span_processor(Hooks())
    with tracer.start_as_current_span("second"):
        pass
    assert calls == ["start second", "ending second", "end second"]
    assert [s.name for s in memory.get_finished_spans()] == ["first", "second"]


def test_events_keep_their_attributes_as_the_sdk_does(pair: tuple[Pair, Pair]) -> None:
    limits = SpanLimits(max_event_attributes=2)
    for (p, memory) in (provider(TracerProvider, span_limits=limits), provider(RecordingTracerProvider, span_limits=limits)):
        span = p.get_tracer("t").start_span("s")
        span.add_event("plain", {"a": 1, "b": "x"})
        span.add_event("over", {"a": 1, "b": 2, "c": 3})
        span.add_event("typed", {"list": ["x", "y"]})
        span.add_event("bare")
        span.end()
        events = memory.get_finished_spans()[0].events
        assert [(e.name, dict(e.attributes or {}), e.dropped_attributes) for e in events] == [
            ("plain", {"a": 1, "b": "x"}, 0), ("over", {"b": 2, "c": 3}, 1), ("typed", {"list": ("x", "y")}, 0),
            ("bare", {}, 0)]
        with pytest.raises(TypeError):
            events[0].attributes["a"] = 2  # type: ignore[index]


TRACEPARENTS = [
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03", "00-00000000000000000000000000000000-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x", " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 ",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331", "garbage", ""]


@pytest.mark.parametrize("traceparent", TRACEPARENTS)
def test_trace_context_is_read_as_the_w3c_propagator_reads_it(traceparent: str) -> None:
    propagator = TraceContextTextMapPropagator()
    want = api.get_current_span(propagator.extract({"traceparent": traceparent} if traceparent else {}))
    for carrier in ({"traceparent": traceparent}, {"traceparent": traceparent, "tracestate": "a=1,b=2"}):
        expected = api.get_current_span(propagator.extract(carrier)).get_span_context()
        assert api.get_current_span(extract_context(carrier)).get_span_context() == expected
        assert api.get_current_span(extract_grpc_context(list(carrier.items()))).get_span_context() == expected
    got = api.get_current_span(traceparent_context(traceparent))
    assert got.get_span_context() == want.get_span_context() and type(got) is type(want)
    wanted = want.get_span_context()
    assert [link.context for link in span_link(traceparent)] == ([wanted] if wanted.is_valid else [])


@pytest.mark.parametrize("state", [None, "a=1,b=2"])
def test_trace_context_is_written_as_the_w3c_propagator_writes_it(state: str | None) -> None:
    propagator = TraceContextTextMapPropagator()
    parent = api.SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                             trace_flags=api.TraceFlags(3),
                             trace_state=api.TraceState.from_header([state]) if state else None)
    for span in (api.NonRecordingSpan(parent), api.INVALID_SPAN):
        with api.use_span(span):
            want: dict[str, str] = {}
            propagator.inject(want)
            assert inject_headers({"k": "v"}) == {"k": "v", **want}
            assert inject_grpc_metadata([("k", "v")]) == [("k", "v"), *want.items()]
            assert current_traceparent() == want.get("traceparent", "")


@pytest.mark.parametrize("given", ["none", "remote", "empty"])
@pytest.mark.parametrize("around", ["nothing", "remote"])
def test_the_no_op_current_span_is_what_the_no_op_tracer_makes_current(given: str, around: str) -> None:
    """NoOpCurrentSpan (a module tracer's `start_as_current_span` without an SDK) makes current what the API's
    no-op tracer makes current, inside and after the block, a failure included."""
    contexts = {"none": None, "remote": traceparent_context("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
                "empty": traceparent_context("")}
    outer = traceparent_context("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01") if around == "remote" else None
    seen: list[Any] = []
    for make in (lambda: api.NoOpTracer().start_as_current_span("s", context=contexts[given]),
                 lambda: NoOpCurrentSpan(contexts[given])):
        token = otel_context.attach(outer) if outer is not None else None
        try:
            with pytest.raises(ValueError), make() as span:
                seen.append((span.get_span_context(), api.get_current_span().get_span_context(), current_traceparent()))
                raise ValueError("inside")
            seen.append(api.get_current_span().get_span_context())
        finally:
            if token is not None:
                otel_context.detach(token)
    assert seen[:2] == seen[2:]


@pytest.mark.parametrize("base", [DEFAULT_ON, ParentBased(TraceIdRatioBased(0.5)), ParentBased(ALWAYS_OFF),
                                  ParentBased(ALWAYS_ON, remote_parent_sampled=ALWAYS_OFF), TraceIdRatioBased(0.5),
                                  ALWAYS_ON])
def test_the_tracers_sampling_shortcuts_decide_as_the_sampler_does(base: sdk_sampling.Sampler) -> None:
    """RecordingTracer decides a sampled parent's child and a root itself where PeriodicSampler's base samples
    them always: every span's decision and trace state is the sampler's own for that span's trace id."""
    sampler = PeriodicSampler(base, 0.5)
    ours = RecordingTracerProvider(sampler=sampler)
    ours.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tracer = ours.get_tracer("t")
    state = api.TraceState([("k", "v")])
    remote = {flags: api.set_span_in_context(api.NonRecordingSpan(api.SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True, trace_flags=api.TraceFlags(flags),
        trace_state=state))) for flags in (0, 1)}
    with tracer.start_as_current_span("local-parent") as local:
        local_context = api.set_span_in_context(local)
    cases = [(remote[1], None), (remote[0], None), (local_context, None), (None, None), (None, {"gpu_dra.periodic": True}),
             (None, {"a": 1})]
    for _ in range(20):
        for parent, attributes in cases:
            span = tracer.start_span("s", context=parent, attributes=attributes)
            made = span.get_span_context()
            want = sampler.should_sample(parent, made.trace_id, "s", attributes=attributes)
            assert span.is_recording() == want.decision.is_recording()
            assert made.trace_flags.sampled == want.decision.is_sampled()
            assert made.trace_state == (want.trace_state or api.DEFAULT_TRACE_STATE)
            assert made.is_valid and made.trace_flags.random_trace_id == (parent is None or parent is local_context)
            if span.is_recording():
                recorded: Any = span
                assert dict(recorded.attributes or {}) == dict(want.attributes or {})
            span.end()
    ours.shutdown()
