"""A span while it runs, kept as little as it can be: what the span is (name, ids, parent, kind, start), and
the calls made on it, in order, to be replayed on the SDK's span later.

On a node's hot path a span costs most where it is made, in the SDK's model: checked attributes, limits,
events and links objects, the processors' hooks. Where every span processor is a batch processor whose
exporter rebuilds spans (`shared.tracing_record.Rebuilding`), none of that has to happen on the event loop:
`RecordingTracer.start_span` makes a `LiveSpan`, which
- draws its ids and takes its start time at once (children, `traceparent`s and links need them now);
- keeps its attributes, events, links, status and name changes as the calls that made them (an event's time
  and an exception's text are taken at the call, as the SDK takes them);
- at its end, takes the end time and goes on the batch processors' queues as it is.

The exporter's thread rebuilds each into the SDK's span (`shared.tracing_record.rebuild`): a `RecordedSpan`
with the same ids and times, on which the calls are made again, in order, so limits, cleaning and status
rules are the SDK's own. The API's and the SDK's readers (`get_span_context`, `is_recording`, `context`,
`name`, `kind`, `parent`, `start_time`, `end_time`) answer from the live span itself. This module needs the
API only: `shared.telemetry` knows the class without loading the SDK.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Mapping, Sequence
from time import time_ns
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util import types

from shared.logs import get_logger

_log = get_logger(__name__)
_REBUILD_LOCK = threading.Lock()  # the first exporter to read a span rebuilds it; another waits for that one


class LiveSpan(trace_api.Span):
    """A recording span (module doc): its identity now, everything else replayed on the SDK's span later."""

    __slots__ = ("_calls", "_context", "_end_time", "_flags", "_kind", "_links", "_name", "_parent",
                 "_pending", "_rebuilt", "_setup", "_start_time")

    def __init__(self, name: str, context: trace_api.SpanContext, parent: trace_api.SpanContext | None,
                 setup: Any, attributes: types.Attributes, kind: SpanKind, links: Sequence[Link] | None,
                 start_time: int | None, flags: tuple[bool, bool] | None = None) -> None:
        self._name = name
        self._context = context
        self._parent = parent
        self._setup = setup  # the tracer's TracerSetup: what the rebuilt span shares with the tracer's others
        self._pending = dict(attributes) if attributes else None  # a copy, as the SDK's: the caller may change its
        self._kind = kind
        self._links = links or None
        self._start_time = start_time if start_time is not None else time_ns()
        self._end_time: int | None = None
        self._calls: list[tuple[str, tuple[Any, ...]]] | None = None
        self._flags = flags  # (record_exception, set_status_on_exception) where not both True
        self._rebuilt: Any = None

    def _call(self, method: str, *args: Any) -> None:
        """Keep a call for the rebuilt span; refused once the span has ended, as the SDK refuses it."""
        if self._end_time is not None:
            _log.warning("span not changed: it has ended", span=self._name, call=method)
            return
        if self._calls is None:
            self._calls = [(method, args)]
        else:
            self._calls.append((method, args))

    # -- the API's span --

    def get_span_context(self) -> trace_api.SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attributes(self, attributes: Mapping[str, types.AnyValue]) -> None:
        self._call("set_attributes", dict(attributes))

    def set_attribute(self, key: str, value: types.AnyValue) -> None:
        self._call("set_attributes", {key: value})

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        self._call("add_event", name, dict(attributes) if attributes else None,
                   timestamp if timestamp is not None else time_ns())

    def add_link(self, context: trace_api.SpanContext, attributes: types.Attributes = None) -> None:
        self._call("add_link", context, dict(attributes) if attributes else None)

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name
        else:
            _log.warning("span not renamed: it has ended", span=self._name)

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        self._call("set_status", status, description)

    def record_exception(self, exception: BaseException, attributes: types.Attributes = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        """The SDK's exception event (its attribute names and text, taken now)."""
        module, qualname = type(exception).__module__, type(exception).__qualname__
        recorded: dict[str, types.AnyValue] = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            recorded.update(attributes)
        self.add_event("exception", recorded, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            _log.warning("span ended twice: the second end is ignored", span=self._name)
            return
        self._end_time = end_time if end_time is not None else time_ns()
        for on_end in self._setup.plan.ends:
            on_end(self)

    def __exit__(self, exc_type: type[BaseException] | None, exc_val: BaseException | None, exc_tb: Any) -> None:
        """`with tracer.start_span(...) as span`: as the SDK's span, the escaping exception recorded and the
        status set (unless the span was started not to), then the end."""
        if exc_val is not None and self._end_time is None:
            record, set_status = self._flags or (True, True)
            if record:
                self.record_exception(exc_val, escaped=True)
            if set_status:
                self.set_status(Status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}"))
        self.end()

    # -- what a processor reads before the span is rebuilt --

    @property
    def context(self) -> trace_api.SpanContext:
        return self._context

    @property
    def name(self) -> str:
        return self._name

    @property
    def kind(self) -> SpanKind:
        return self._kind

    @property
    def parent(self) -> trace_api.SpanContext | None:
        return self._parent

    @property
    def start_time(self) -> int:
        return self._start_time

    @property
    def end_time(self) -> int | None:
        return self._end_time

    def rebuilt(self, rebuild: Any) -> Any:
        """The SDK's span for this one, made once by `rebuild(self)` (shared.tracing_record.rebuild)."""
        made = self._rebuilt
        if made is None:
            with _REBUILD_LOCK:
                made = self._rebuilt
                if made is None:
                    made = self._rebuilt = rebuild(self)
        return made
