"""`gpu-dra trace CLAIM`: one claim's trace as a terminal waterfall, from a span file.

Reads the local cluster's span store (the JSON-lines file the services write with
`GPU_DRA_OTEL_EXPORTER=file:<data dir>/traces.jsonl`, as `gpu-dra demo` sets) or an OTLP-JSON file
(the collector's `file` exporter: one ExportTraceServiceRequest per line, or one document). CLAIM is
the claim's UID or `NAMESPACE/NAME` (the namespace defaults to `default`); the trace chosen is the one
the scheduler started for it (or, failing that, the one with the most spans naming the claim).
Exit 0 with a waterfall, 1 when the file has no trace of the claim, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from embedded.cluster.waterfall import render

Span = dict[str, Any]


def _otlp_value(value: dict[str, Any]) -> Any:
    if "arrayValue" in value:
        return [_otlp_value(v) for v in value["arrayValue"].get("values") or []]
    for kind in ("stringValue", "boolValue", "doubleValue"):
        if kind in value:
            return value[kind]
    if "intValue" in value:
        return int(value["intValue"])
    return None


def _otlp_spans(doc: dict[str, Any]) -> list[Span]:
    """The spans of one OTLP-JSON ExportTraceServiceRequest, in the span store's flat shape."""
    out: list[Span] = []
    for rs in doc.get("resourceSpans") or []:
        resource = {a["key"]: _otlp_value(a.get("value") or {}) for a in (rs.get("resource") or {}).get("attributes") or []}
        for ss in rs.get("scopeSpans") or []:
            for s in ss.get("spans") or []:
                out.append({
                    "name": s.get("name", ""), "service": resource.get("service.name"),
                    "node": resource.get("k8s.node.name", ""), "trace_id": s.get("traceId", ""),
                    "span_id": s.get("spanId", ""), "parent_span_id": s.get("parentSpanId", ""),
                    "start_ns": int(s.get("startTimeUnixNano") or 0), "end_ns": int(s.get("endTimeUnixNano") or 0),
                    "status": "ERROR" if (s.get("status") or {}).get("code") in (2, "STATUS_CODE_ERROR") else "OK",
                    "attributes": {a["key"]: _otlp_value(a.get("value") or {}) for a in s.get("attributes") or []}})
    return out


def read_span_file(path: Path) -> list[Span]:
    """Spans from a span-store (JSON lines) or OTLP-JSON file; lines that are not JSON are skipped."""
    text = path.read_text(encoding="utf-8")
    try:
        docs: list[Any] = [json.loads(text)]
    except ValueError:
        docs = []
        for line in text.splitlines():
            try:
                docs.append(json.loads(line))
            except ValueError:
                continue  # a line still being written
    spans: list[Span] = []
    for doc in docs:
        if isinstance(doc, dict) and "resourceSpans" in doc:
            spans += _otlp_spans(doc)
        elif isinstance(doc, dict) and "trace_id" in doc:
            spans.append(doc)
    return spans


def _names_claim(span: Span, claim: str) -> bool:
    attrs = span.get("attributes") or {}
    if attrs.get("dra.claim.uid") == claim:
        return True
    namespace, _, name = claim.rpartition("/")
    return bool(name) and attrs.get("dra.claim.name") == name and attrs.get("k8s.namespace.name") == (namespace or "default")


def claim_trace(spans: list[Span], claim: str) -> list[Span]:
    """The spans of the claim's trace (empty when no span names the claim)."""
    naming = [s for s in spans if _names_claim(s, claim)]
    if not naming:
        return []
    started = [s for s in naming if s["name"] == "scheduler.allocate_claim"]
    if started:
        trace_id = started[-1]["trace_id"]  # the latest allocation of the claim
    else:
        counts: dict[str, int] = {}
        for s in naming:
            counts[s["trace_id"]] = counts.get(s["trace_id"], 0) + 1
        trace_id = max(counts, key=lambda t: counts[t])
    return [s for s in spans if s["trace_id"] == trace_id]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-dra trace", description="One claim's trace as a terminal waterfall.")
    parser.add_argument("claim", help="the claim's UID, or NAMESPACE/NAME")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--file", type=Path, help="a span-store (JSON lines) or OTLP-JSON file")
    where.add_argument("--data-dir", type=Path, help="a local cluster's data dir (reads its traces.jsonl)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    path: Path = args.file or args.data_dir / "traces.jsonl"
    try:
        spans = read_span_file(path)
    except OSError as exc:
        print(f"gpu-dra trace: error: cannot read {path}: {exc.strerror or exc} (run the cluster with "
              "GPU_DRA_OTEL_EXPORTER=file:<data dir>/traces.jsonl, or give an OTLP-JSON file)", file=sys.stderr)
        return 1
    trace = claim_trace(spans, args.claim)
    if not trace:
        print(f"gpu-dra trace: error: no span in {path} names claim {args.claim!r} (attributes dra.claim.uid, "
              f"or dra.claim.name with k8s.namespace.name); {len(spans)} spans read", file=sys.stderr)
        return 1
    print(render(trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
