"""Structured log lines carry the current trace and span ids and keyword fields."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest
from opentelemetry import trace

from shared.logs import _Formatter, get_logger, setup_logging
from shared.telemetry import setup_telemetry


def test_json_log_line_has_trace_ids_and_fields() -> None:
    setup_telemetry("tests", "memory")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("test.logs")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    with trace.get_tracer(__name__).start_as_current_span("work") as span:
        get_logger("test.logs").info("claim prepared", claim="ns/c1", devices=2)
        line = json.loads(_Formatter("json", "preparer").format(records[0]))
    ctx = span.get_span_context()
    assert line["trace_id"] == f"{ctx.trace_id:032x}" and line["span_id"] == f"{ctx.span_id:016x}"
    assert (line["msg"], line["claim"], line["devices"], line["service"]) == ("claim prepared", "ns/c1", 2, "preparer")


def test_the_service_log_follows_stderr_when_it_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `gpu-dra` command run in-process (as tests and embedding programs do) sets up logging while sys.stderr is
    one stream; when that stream is replaced and closed, records go to the stream of the moment, not to the closed
    one (which printed `--- Logging error ---` for every record after)."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    first, second = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", first)
        setup_logging("tests", "info")
        monkeypatch.setattr(sys, "stderr", second)
        first.close()
        get_logger("test.logs").error("written after stderr changed", claim="ns/c1")
    finally:
        root.handlers[:], root.level = saved
    assert "written after stderr changed" in second.getvalue() and "claim=ns/c1" in second.getvalue()
    assert "Logging error" not in second.getvalue()
