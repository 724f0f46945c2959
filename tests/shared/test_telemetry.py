"""Tracing set-up: no exporter means the no-op tracer (nothing recorded), and a caller's context still passes
through; an exporter records spans. Each case in a fresh interpreter: a tracer provider is process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    out = subprocess.run([sys.executable, "-c", SCRIPT, exporter, PARENT], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    return out.stdout.split()


def test_no_exporter_installs_no_provider_and_the_callers_trace_passes_through() -> None:
    assert run("none") == ["True", "False", "0af7651916cd43dd8448eb211c80319c", "0"]


def test_an_exporter_records_spans_in_the_callers_trace() -> None:
    assert run("memory") == ["False", "True", "0af7651916cd43dd8448eb211c80319c", "2"]
