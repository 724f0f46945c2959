"""The dashboard's drill-down from the local cluster's tools: explain a pod (`gpu-dra explain`'s plan), why a
waiting pod waits, and a claim's trace waterfall from a span store. Registered in pyproject.toml's
`gpu_dra.dashboard_tools` group, which services/dashboard/main.py reads: the dashboard uses this code rather than
a copy where the install has it, and a production image (without embedded/) answers 501."""

from __future__ import annotations

import asyncio
from pathlib import Path

from embedded.cluster.tracecli import claim_trace
from embedded.cluster.waterfall import read_spans, render
from services.dashboard.pending import Reasoner
from services.dashboard.server import Explainer, Waterfall
from shared.kube.resources import Kube


def explainer(kubeconfig: str) -> Explainer:
    async def explain(namespace: str, name: str) -> str:
        from embedded.cluster import explain as tool  # on first use: the scheduler's code is not small

        try:
            return await tool.explain("pod", namespace, name, kubeconfig)
        except tool.NotFound as exc:
            return str(exc)

    return explain


def reasoner(kube: Kube) -> Reasoner:
    """What a waiting pod asks for and why it waits, from explain's plan on the dashboard's own client."""

    async def reason(namespace: str, name: str) -> tuple[str, str]:
        from embedded.cluster.explain import why_waiting

        waiting = await why_waiting(namespace, name, kube)
        return waiting.asks, waiting.reason

    return reason


def waterfall(span_store: str) -> Waterfall | None:
    if not span_store:
        return None

    async def draw(claim_uid: str) -> str | None:
        trace = claim_trace(await asyncio.to_thread(read_spans, Path(span_store)), claim_uid)
        return render(trace) if trace else None

    return draw
