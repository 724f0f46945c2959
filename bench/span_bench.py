"""Span microbenchmark: what one span of each kind the preparer records costs on the event loop's thread.

The kinds are the preparer's, made as its code makes them: the RPC's server span (`DraCore.run`), the
claim's `claim.prepare` (a link, five attributes, the `claim.get` event, the devices set after),
a leaf span (`cdi.write`, `checkpoint.write`: `shared.telemetry.leaf_span`) and a lifecycle event's
producer span (`Bus._outgoing`, with the headers it injects); then a whole prepare's set (server +
claim + two leaves) and the file exporter's encoding per span (done on the batch processor's thread).

Each is timed with tracers of two providers: `sdk` (what `shared.tracing_sdk.build_provider` makes, the SDK's
TracerProvider, every span exported to a file as with GPU_DRA_OTEL_EXPORTER=file:...) and `noop` (no provider:
the API's no-op tracer, as with no exporter). Figures: microseconds per span (per prepare for the set), the median of
--repeats runs of --n spans; the batch processor's thread runs as it does in a service.

Run: `.venv/bin/python bench/span_bench.py [--n 20000] [--repeats 5] [--out bench/results/span.json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry import context as otel_context  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from shared import tracing_sdk  # noqa: E402
from shared.telemetry import (  # noqa: E402
    inject_headers,
    kubelet_context,
    leaf_span,
    span_link,
    traceparent_context,
)

KUBELET_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SCHEDULER_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def providers(path: str) -> dict[str, trace.TracerProvider]:
    """`sdk`: what `shared.tracing_sdk.build_provider` makes (the SDK's provider) with a span file; `noop`: none."""
    sdk, _ = tracing_sdk.build_provider("preparer-node-1", f"file:{path}", otlp=False, node="node-1", periodic=0.01)
    return {"noop": trace.NoOpTracerProvider(), "sdk": sdk}


def kinds(tracer: trace.Tracer) -> dict[str, Callable[[], None]]:
    """One call of each: the preparer's span kinds, as its code makes them."""
    server_parent = traceparent_context(KUBELET_TRACEPARENT)
    server_attrs: dict[str, str | int] = {
        "rpc.system": "grpc",
        "rpc.service": "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
        "rpc.method": "NodePrepareResources",
        "dra.claims": 1,
    }

    def server() -> None:
        with (
            kubelet_context(True),
            tracer.start_as_current_span(
                "NodePrepareResources", context=server_parent, kind=SpanKind.SERVER, attributes=server_attrs
            ),
        ):
            pass

    def claim() -> None:
        links = span_link(SCHEDULER_TRACEPARENT)
        attributes: dict[str, str] = {
            "dra.claim.uid": "0c5e7c1e-6f1b-4d6e-9a53-3f1d8d1b2a10",
            "dra.claim.name": "claim-1",
            "k8s.namespace.name": "default",
            "dra.driver": "gpu.nvidia.com",
            "k8s.node.name": "node-1",
            "k8s.pod.uid": "5b7f3f2c-9a0e-4a4b-8c7e-1e0b0f6a9d21",
        }
        with tracer.start_as_current_span("claim.prepare", links=links, attributes=attributes) as span:
            if span.is_recording():
                span.add_event("claim.get", {"dra.claim.get_ms": 0.412})
                span.set_attributes(
                    {
                        "dra.device": ["gpu-0"],
                        "gpu.uuid": ["GPU-8f0c3a1e-0000-0000-0000-000000000000"],
                        "cdi.device_ids": ["k8s.gpu.nvidia.com/claim=0c5e7c1e-gpu-0"],
                    }
                )

    def leaf() -> None:
        with leaf_span(tracer, "checkpoint.write", {"checkpoint.events": 1}):
            pass

    def producer() -> None:
        with tracer.start_as_current_span(
            "publish claim.prepared",
            kind=SpanKind.PRODUCER,
            attributes={"messaging.system": "nats", "messaging.destination.name": "dra.v1.claim.node-1.prepared"},
        ):
            inject_headers({"ce-id": "x"})

    def prepare() -> None:
        with (
            kubelet_context(True),
            tracer.start_as_current_span(
                "NodePrepareResources", context=server_parent, kind=SpanKind.SERVER, attributes=server_attrs
            ),
        ):
            claim_with_leaves()

    def claim_with_leaves() -> None:
        with tracer.start_as_current_span(
            "claim.prepare",
            links=span_link(SCHEDULER_TRACEPARENT),
            attributes={"dra.claim.uid": "u", "dra.claim.name": "c", "k8s.namespace.name": "default"},
        ):
            with leaf_span(tracer, "cdi.write"):
                pass
            with leaf_span(tracer, "checkpoint.write", {"checkpoint.events": 1}):
                pass

    local = trace.set_span_in_context(
        trace.NonRecordingSpan(
            trace.SpanContext(
                0x0AF7651916CD43DD8448EB211C80319C,
                0x00F067AA0BA902B7,
                False,
                trace.TraceFlags(trace.TraceFlags.SAMPLED),
            )
        )
    )

    def inside(call: Callable[[], None]) -> Callable[[], None]:
        """`call` as the preparer makes it: within a (sampled, local) parent span, its child."""

        def run() -> None:
            token = otel_context.attach(local)
            try:
                call()
            finally:
                otel_context.detach(token)

        return run

    return {
        "server": server,
        "claim.prepare": inside(claim),
        "leaf": inside(leaf),
        "producer": inside(producer),
        "prepare (4 spans)": prepare,
    }


def timed(call: Callable[[], None], n: int, flush: Callable[[], object]) -> float:
    """Microseconds per call over n calls (thread CPU time: the export thread's share is not counted), in
    chunks of 500 with the exporter flushed between (untimed), so its queue never fills."""
    spent = 0
    for _ in range(max(1, n // 500)):
        began = time.thread_time_ns()
        for _ in range(500):
            call()
        spent += time.thread_time_ns() - began
        flush()
    return spent / (max(1, n // 500) * 500) / 1e3


def export_cost(path: str, n: int) -> float:
    """Microseconds per span for the file exporter to encode and write a batch of finished claim spans."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    collect = TracerProvider(resource=tracing_sdk.service_resource("preparer-node-1", "node-1"))
    collect.add_span_processor(SimpleSpanProcessor(memory))
    kinds(collect.get_tracer("bench"))["claim.prepare"]()
    spans = list(memory.get_finished_spans()) * 512
    exporter = tracing_sdk.JsonLinesSpanExporter(path)
    rounds = max(1, n // 512)
    began = time.thread_time_ns()
    for _ in range(rounds):
        exporter.export(spans)
    return round((time.thread_time_ns() - began) / (rounds * len(spans)) / 1e3, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=20000, help="spans per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per kind and provider (median taken)")
    parser.add_argument("--out", default="bench/results/span.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "spans.jsonl")
        made = providers(path)
        results: dict[str, dict[str, float]] = {}
        for name, provider in made.items():
            calls = kinds(provider.get_tracer("bench"))
            flush = provider.force_flush if isinstance(provider, TracerProvider) else (lambda: None)
            for call in calls.values():
                timed(call, 500, flush)  # warm-up
            for kind, call in calls.items():
                runs = []
                for _ in range(args.repeats):
                    runs.append(timed(call, args.n, flush))
                    if os.path.exists(path):
                        os.truncate(path, 0)
                results.setdefault(kind, {})[name] = round(statistics.median(runs), 2)
        results["file export, per span (exporter thread)"] = {"sdk": export_cost(path, args.n)}
        for provider in made.values():
            if isinstance(provider, TracerProvider):
                provider.shutdown()
    print(f"{'us per span (thread CPU)':<44}{'noop':>8}{'sdk':>8}")
    for kind, row in results.items():
        print(f"{kind:<44}" + "".join(f"{row[p]:>8.2f}" if p in row else f"{'-':>8}" for p in ("noop", "sdk")))
    out = {
        "what": "microseconds of the calling thread's CPU per span (per prepare for the 4-span set), median of "
        f"{args.repeats} runs of {args.n}; every span exported to a file (batch processor)",
        "cpus": os.cpu_count(),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
