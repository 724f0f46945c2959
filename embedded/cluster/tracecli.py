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
import sys
from pathlib import Path

from embedded.cluster.waterfall import Span, parse_spans, render


def _names_claim(span: Span, claim: str) -> bool:
    attrs = span.get("attributes") or {}
    if attrs.get("dra.claim.uid") == claim:
        return True
    namespace, _, name = claim.rpartition("/")
    return (
        bool(name)
        and attrs.get("dra.claim.name") == name
        and attrs.get("k8s.namespace.name") == (namespace or "default")
    )


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
        spans = parse_spans(path.read_text(encoding="utf-8"))
    except OSError as exc:
        print(
            f"gpu-dra trace: error: cannot read {path}: {exc.strerror or exc} (run the cluster with "
            "GPU_DRA_OTEL_EXPORTER=file:<data dir>/traces.jsonl, or give an OTLP-JSON file)",
            file=sys.stderr,
        )
        return 2
    trace = claim_trace(spans, args.claim)
    if not trace:
        print(
            f"gpu-dra trace: error: no span in {path} names claim {args.claim!r} (attributes dra.claim.uid, "
            f"or dra.claim.name with k8s.namespace.name); {len(spans)} spans read",
            file=sys.stderr,
        )
        return 1
    print(render(trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
