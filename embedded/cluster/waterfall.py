"""A terminal waterfall of one trace, from the JSON-lines span files the local cluster's services write.

Owns reading span files, choosing a trace (by a root span name), and drawing it as an indented tree
with a time bar per span: service, span name, offset and duration.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

BAR_WIDTH = 32
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
        resource = {
            a["key"]: _otlp_value(a.get("value") or {}) for a in (rs.get("resource") or {}).get("attributes") or []
        }
        for ss in rs.get("scopeSpans") or []:
            for s in ss.get("spans") or []:
                out.append(
                    {
                        "name": s.get("name", ""),
                        "service": resource.get("service.name"),
                        "node": resource.get("k8s.node.name", ""),
                        "trace_id": s.get("traceId", ""),
                        "span_id": s.get("spanId", ""),
                        "parent_span_id": s.get("parentSpanId", ""),
                        "start_ns": int(s.get("startTimeUnixNano") or 0),
                        "end_ns": int(s.get("endTimeUnixNano") or 0),
                        "status": "ERROR" if (s.get("status") or {}).get("code") in (2, "STATUS_CODE_ERROR") else "OK",
                        "attributes": {a["key"]: _otlp_value(a.get("value") or {}) for a in s.get("attributes") or []},
                    }
                )
    return out


def parse_spans(text: str) -> list[Span]:
    """Spans from a span store's text (JSON lines) or an OTLP-JSON file's (one ExportTraceServiceRequest per
    line, or one document); lines that are not JSON are skipped (one may be being written)."""
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


def read_spans(path: Path) -> list[Span]:
    """The spans of a span file; none when it cannot be read (no span written yet)."""
    try:
        return parse_spans(path.read_text(encoding="utf-8"))
    except OSError:
        return []


def traces_with(spans: list[dict[str, Any]], name_part: str) -> list[list[dict[str, Any]]]:
    """Traces containing a span whose name contains `name_part`, biggest first."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    chosen = [t for t in by_trace.values() if any(name_part in s["name"] for s in t)]
    return sorted(chosen, key=lambda t: (-len({s.get("service") for s in t}), -len(t)))


def render(trace: list[dict[str, Any]]) -> str:
    """An indented tree, children under parents in start order, with bars on a shared time axis."""
    ids = {s["span_id"] for s in trace}
    children: dict[str, list[dict[str, Any]]] = defaultdict(list)
    roots = []
    for span in trace:
        if span["parent_span_id"] and span["parent_span_id"] in ids:
            children[span["parent_span_id"]].append(span)
        else:
            roots.append(span)
    t0 = min(s["start_ns"] for s in trace)
    t1 = max(s["end_ns"] for s in trace)
    total = max(t1 - t0, 1)
    lines = [
        f"trace {trace[0]['trace_id']}  {total / 1e6:.1f} ms, {len(trace)} spans, "
        f"{len({s.get('service') for s in trace})} services"
    ]

    def walk(span: dict[str, Any], depth: int) -> None:
        start = (span["start_ns"] - t0) / total
        width = max((span["end_ns"] - span["start_ns"]) / total, 0.0)
        lo = int(start * BAR_WIDTH)
        hi = max(lo + 1, int((start + width) * BAR_WIDTH))
        bar = " " * lo + "█" * (hi - lo) + " " * (BAR_WIDTH - hi)
        label = f"{'  ' * depth}{span['name']}"
        service = str(span.get("service") or "").removeprefix("gpu-dra-")
        if span.get("node"):
            service += f"@{span['node']}"  # one service, many nodes: the node tells them apart
        dur_ms = (span["end_ns"] - span["start_ns"]) / 1e6
        flag = " !" if span.get("status") == "ERROR" else ""
        lines.append(f"  {service[:22]:<22} {label[:52]:<52} |{bar}| {dur_ms:8.2f} ms{flag}")
        for child in sorted(children[span["span_id"]], key=lambda s: s["start_ns"]):
            walk(child, depth + 1)

    for root in sorted(roots, key=lambda s: s["start_ns"]):
        walk(root, 0)
    return "\n".join(lines)
