"""Tracing set-up: no exporter means the no-op tracer (nothing recorded), and a caller's context still passes
through; an exporter records spans. Each case in a fresh interpreter: a tracer provider is process-wide."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.otlpreceiver import Spans, grpc_receiver, http_receiver

REPO = Path(__file__).resolve().parents[2]
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

SCRIPT = """
import sys
from shared.telemetry import extract_grpc_context, get_tracer, inject_headers, memory_spans, setup_telemetry
provider = setup_telemetry("t", sys.argv[1])
tracer = get_tracer("t")
with tracer.start_as_current_span("rpc", context=extract_grpc_context([("traceparent", sys.argv[2])])) as span:
    with tracer.start_as_current_span("inner"):
        headers = inject_headers()
    recording = span.is_recording()
print(provider is None, recording, headers["traceparent"].split("-")[1], len(memory_spans()))
"""


def run(exporter: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, exporter, PARENT],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    return out.stdout.split()


def test_no_exporter_installs_no_provider_and_the_callers_trace_passes_through() -> None:
    assert run("none") == ["True", "False", "0af7651916cd43dd8448eb211c80319c", "0"]


def test_an_exporter_records_spans_in_the_callers_trace() -> None:
    assert run("memory") == ["False", "True", "0af7651916cd43dd8448eb211c80319c", "2"]


OTLP_SCRIPT = """
from shared.telemetry import current_traceparent, get_tracer, setup_telemetry, shutdown_telemetry
setup_telemetry("preparer-n1", "none", node="n1")
with get_tracer("t").start_as_current_span("work"):
    print(current_traceparent())
shutdown_telemetry()
"""


@pytest.mark.parametrize(
    ("protocol", "sampler"), [("http/protobuf", "parentbased_always_on"), ("grpc", ""), ("grpc", "traceidratio")]
)
def test_otlp_over_the_protocol_the_env_names_with_the_services_resource_and_head_sampling(
    protocol: str, sampler: str
) -> None:
    spans = Spans()
    stop: Callable[[], object]
    if protocol == "grpc":
        server, port = grpc_receiver(spans)
        stop = lambda: server.stop(0)  # noqa: E731
    else:
        http = http_receiver(spans)
        port, stop = http.server_address[1], http.shutdown
    try:
        env = {
            "PYTHONPATH": str(REPO),
            "PATH": "/usr/bin:/bin",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        }
        if sampler:
            env |= {"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": "0"}
        out = subprocess.run(
            [sys.executable, "-c", OTLP_SCRIPT],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env=env,
        )
    finally:
        stop()
    traceparent = out.stdout.strip()
    if sampler == "traceidratio":  # sampled out: not exported, yet the context propagates, unsampled
        assert spans.snapshot() == [] and not int(traceparent.split("-")[3], 16) & 1, (traceparent, out.stderr)
        return
    (span,) = spans.snapshot()
    assert traceparent.split("-")[1:3] == [span.trace_id, span.span_id]
    assert span.name == "work"
    assert span.resource["service.name"] == "gpu-dra-preparer"
    assert span.resource["k8s.node.name"] == "n1"
    assert span.resource["service.version"] and span.resource["service.instance.id"]


PERIODIC_SCRIPT = """
from shared.telemetry import PERIODIC, get_tracer, setup_telemetry
setup_telemetry("publisher", "memory")
tracer = get_tracer("t")
with tracer.start_as_current_span("resync", attributes={PERIODIC: True}) as idle:
    pass
with tracer.start_as_current_span("inventory-changed") as cause:
    with tracer.start_as_current_span("sync", attributes={PERIODIC: True}) as caused:
        pass
print(idle.is_recording() or idle.get_span_context().trace_flags.sampled, cause.get_span_context().trace_flags.sampled,
      caused.get_span_context().trace_flags.sampled)
"""


@pytest.mark.parametrize(("ratio", "idle_kept"), [("0", "False"), ("1", "True")])
def test_periodic_roots_are_sampled_at_their_own_ratio_and_work_they_join_is_not(ratio: str, idle_kept: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PERIODIC_SCRIPT],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "GPU_DRA_OTEL_PERIODIC_RATIO": ratio},
    )
    assert out.stdout.split() == [idle_kept, "True", "True"], out.stderr


LEAF_SCRIPT = """
from opentelemetry import trace
from shared.telemetry import get_tracer, leaf_span, memory_spans, setup_telemetry
setup_telemetry("t", "memory")
tracer = get_tracer("t")
with tracer.start_as_current_span("claim.prepare") as parent:
    with leaf_span(tracer, "cdi.write", {"cdi.devices": 1}) as leaf:
        current = trace.get_current_span() is parent  # the leaf never became the current span
    try:
        with leaf_span(tracer, "checkpoint.write"):
            raise OSError("disk full")
    except OSError:
        pass
spans = {s.name: s for s in memory_spans()}
ok, failed = spans["cdi.write"], spans["checkpoint.write"]
print(current, ok.parent.span_id == parent.get_span_context().span_id, ok.attributes["cdi.devices"],
      failed.status.status_code.name, failed.events[0].name, failed.end_time is not None)
"""


def test_a_leaf_span_is_the_current_spans_child_without_becoming_current_and_records_a_failure() -> None:
    out = subprocess.run(
        [sys.executable, "-c", LEAF_SCRIPT],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.split() == ["True", "True", "1", "ERROR", "exception", "True"], out.stderr
