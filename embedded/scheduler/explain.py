"""Allocator reports -> text: the `PodScheduled=False` message and the `gpu-dra explain` report.

Owns wording only. The condition message is compact (one clause per node, capped in length); the
report is indented lines per node, request and reason, with example device names.
"""

from __future__ import annotations

from collections.abc import Sequence

from embedded.scheduler.report import ClaimProblem, NodeReport, Rejection, RequestReport

MAX_MESSAGE = 4000


def _devices(r: Rejection) -> str:
    more = f", +{r.count - len(r.devices)} more" if r.count > len(r.devices) else ""
    return f"{', '.join(r.devices)}{more}"


def request_summary(req: RequestReport, with_claim: bool = True) -> str:
    """One clause: what the request wanted and the first reason it did not get it."""
    who = f"claim {req.claim} request {req.request}" if with_claim else f"request {req.request}"
    if req.error:
        return f"{who}: {req.error}"
    parts = [f"{req.eligible} of {req.seen} devices eligible, {req.wanted} wanted"]
    parts += [f"{r.count} {r.reason}" + (f" ({_devices(r)})" if r.detailed else "") for r in req.rejections]
    parts += [f"{r.count}x {r.reason}" for r in req.conflicts]
    return f"{who}: " + "; ".join(parts)


def _why_node(report: NodeReport) -> str:
    if report.problem and not report.failed_requests():
        return report.problem
    failing = _blamed(report)
    clauses = [request_summary(r) for r in failing]
    if report.problem:
        clauses.insert(0, report.problem)
    return " | ".join(clauses) or "no combination of devices satisfies all requests"


def _blamed(report: NodeReport) -> list[RequestReport]:
    """Requests to blame: errors and shortfalls first, else those with search conflicts, else all failed."""
    failed = report.failed_requests()
    short = [r for r in failed if r.error or (r.wanted != "all" and r.eligible < int(r.wanted))]
    if short:
        return short
    conflicted = [r for r in failed if r.conflicts]
    return conflicted or failed


def condition_message(reports: Sequence[NodeReport], problems: Sequence[ClaimProblem] = ()) -> str:
    """`PodScheduled=False` message: `0/N nodes can allocate the pod's claims: node a: ...; node b: ...`."""
    if problems:
        text = "; ".join(f"claim {p.claim}: {p.message}" for p in problems)
        return _cap(f"the pod's claims cannot be allocated on any node: {text}")
    if not reports:
        return "no nodes to schedule on"
    fits = sum(1 for r in reports if r.fits)
    head = f"{fits}/{len(reports)} nodes can allocate the pod's claims: "
    return _cap(head + "; ".join(f"node {r.node}: {_why_node(r)}" for r in reports if not r.fits))


def _cap(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 15] + " ... (truncated)"


def node_lines(report: NodeReport) -> list[str]:
    """The readable report for one node."""
    lines = [f"node {report.node}: {'fits' if report.fits else 'does not fit'}"]
    if report.problem:
        lines.append(f"  problem: {report.problem}")
    lines += [f"  note: {n}" for n in report.notes]
    for req in report.requests:
        head = f"  claim {req.claim}, request {req.request} (class {req.device_class}, wants {req.wanted}): "
        if req.allocated:
            lines.append(head + f"allocated {', '.join(req.allocated)}")
        elif req.error:
            lines.append(head + "cannot be satisfied")
            lines.append(f"    error: {req.error}")
        else:
            lines.append(head + f"{req.eligible} of {req.seen} devices pass the per-device checks")
        for r in req.rejections:
            lines.append(f"    {r.count} rejected: {r.reason} ({_devices(r)})")
        for r in req.conflicts:
            lines.append(f"    {r.count} tried and dropped during the search: {r.reason} ({_devices(r)})")
    return lines


def report_text(reports: Sequence[NodeReport], problems: Sequence[ClaimProblem] = ()) -> str:
    lines: list[str] = []
    for p in problems:
        lines.append(f"claim {p.claim}: {p.message}")
    for report in reports:
        lines += node_lines(report)
    return "\n".join(lines)
