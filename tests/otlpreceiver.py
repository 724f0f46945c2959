"""An in-test OTLP trace receiver, gRPC (the collector's TraceService over grpcio) and HTTP/protobuf
(POST /v1/traces), keeping every span it is sent as a flat `Received` with its resource's attributes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


T = TypeVar("T")


@dataclass
class Received:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    via: str = ""  # the receiver it came through: "grpc" or "http"


class Spans:
    """What the receivers were sent (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.spans: list[Received] = []
        self.requests = 0

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest, via: str = "") -> None:
        got: list[Received] = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Received(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            resource=resource,
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            via=via,
                        )
                    )
        with self._lock:
            self.spans.extend(got)
            self.requests += 1
            self._lock.notify_all()

    def snapshot(self) -> list[Received]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, found: Callable[[list[Received]], T | None], timeout: float) -> T | None:
        """`found(spans)` once it is not None, re-checked at every export received; None at `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while (result := found(list(self.spans))) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(left)
            return result


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, spans: Spans) -> None:
        self.spans = spans

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:  # noqa: N802
        self.spans.add(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()


def grpc_receiver(spans: Spans) -> tuple[grpc.Server, int]:
    """A started gRPC receiver on 127.0.0.1 and its port (stop it with `.stop(0)`)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(spans), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def http_receiver(spans: Spans) -> ThreadingHTTPServer:
    """A serving HTTP receiver on 127.0.0.1 (its port: `.server_address[1]`; stop with `.shutdown()`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_response(404)
                self.end_headers()
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            spans.add(request, "http")
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
