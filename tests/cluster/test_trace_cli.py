"""`gpu-dra trace CLAIM`: a claim's waterfall from the span store's JSON lines and from OTLP-JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from embedded.cluster.tracecli import main

ROOT = Path(__file__).resolve().parents[2]
T1, T2 = "0af7651916cd43dd8448eb211c80319c", "1bf7651916cd43dd8448eb211c80319d"


def store_span(
    name: str, trace: str, span: str, parent: str = "", service: str = "gpu-dra-preparer", **attributes: str
) -> dict:
    return {
        "name": name,
        "service": service,
        "node": "n1",
        "trace_id": trace,
        "span_id": span,
        "parent_span_id": parent,
        "kind": "INTERNAL",
        "start_ns": 1_000_000 + int(span, 16),
        "end_ns": 3_000_000,
        "status": "OK",
        "attributes": attributes,
    }


def test_the_claims_trace_from_the_span_store_by_uid_and_by_name(tmp_path: Path) -> None:
    spans = [
        store_span(
            "scheduler.allocate_claim",
            T1,
            "01",
            service="gpu-dra-scheduler",
            **{"dra.claim.uid": "cu", "dra.claim.name": "c", "k8s.namespace.name": "ml"},
        ),
        store_span("claim.prepare", T1, "02", "01", **{"dra.claim.uid": "cu"}),
        store_span("checkpoint.write", T1, "03", "02"),
        store_span("claim.prepare", T2, "04", **{"dra.claim.uid": "other"}),
    ]
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans) + '{"torn')
    done = subprocess.run(
        [sys.executable, "-m", "shared.cli", "trace", "cu", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"trace {T1}") and "3 spans, 2 services" in lines[0]
    assert "scheduler@n1" in lines[1] and "scheduler.allocate_claim" in lines[1]
    assert "    checkpoint.write" in lines[3]  # indented under claim.prepare
    assert main(["ml/c", "--file", str(tmp_path / "traces.jsonl")]) == 0
    assert main(["default/c", "--file", str(tmp_path / "traces.jsonl")]) == 1  # another namespace's claim


def test_the_claims_trace_from_otlp_json(tmp_path: Path, capsys) -> None:
    def attr(key: str, value: str) -> dict:
        return {"key": key, "value": {"stringValue": value}}

    doc = {
        "resourceSpans": [
            {
                "resource": {"attributes": [attr("service.name", "gpu-dra-preparer"), attr("k8s.node.name", "n1")]},
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": T1,
                                "spanId": "00000000000000a1",
                                "name": "claim.prepare",
                                "startTimeUnixNano": "1000",
                                "endTimeUnixNano": "5000",
                                "attributes": [
                                    attr("dra.claim.uid", "cu"),
                                    {
                                        "key": "dra.device",
                                        "value": {"arrayValue": {"values": [{"stringValue": "gpu-0"}]}},
                                    },
                                ],
                            },
                            {
                                "traceId": T1,
                                "spanId": "00000000000000a2",
                                "parentSpanId": "00000000000000a1",
                                "name": "cdi.write",
                                "startTimeUnixNano": "2000",
                                "endTimeUnixNano": "3000",
                                "status": {"code": 2},
                            },
                        ]
                    }
                ],
            }
        ]
    }
    path = tmp_path / "otlp.json"
    path.write_text(json.dumps(doc) + "\n" + json.dumps(doc).replace(T1, T2).replace('"cu"', '"x"') + "\n")
    assert main(["cu", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"trace {T1}" in out and "preparer@n1" in out and "  cdi.write" in out and out.rstrip().endswith("!")
    assert main(["nope", "--file", str(path)]) == 1
