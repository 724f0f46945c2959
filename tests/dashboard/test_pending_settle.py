"""The pending-pods panel explains a pod once it has waited a while: a burst of pods the scheduler places at
once costs the API server no explain reads (each is seven: the pod, every claim, slice, node and class, its
namespace and events), and a pod that keeps waiting is explained as before."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any

from services.dashboard.pending import PendingPods

SETTLE_S = 0.3


def pod(name: str, *, node: str = "", age_s: float = 0.0) -> dict[str, Any]:
    created = dt.datetime.fromtimestamp(time.time() - age_s, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}", "creationTimestamp": created},
        "spec": {"nodeName": node, "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one"}]},
        "status": {"phase": "Pending"},
    }


async def test_a_pod_placed_before_it_settles_is_never_explained_and_one_that_waits_is() -> None:
    asked: list[str] = []
    explained = asyncio.Event()

    async def reasoner(namespace: str, name: str) -> tuple[str, str]:
        asked.append(name)
        explained.set()
        return "1 x gpu.nvidia.com", "no node has a free GPU"

    pending = PendingPods(None, reasoner, on_change=lambda: None, recheck_s=0.01, settle_s=SETTLE_S)  # type: ignore[arg-type]
    stopping = asyncio.Event()
    runner = asyncio.create_task(pending.run(stopping))
    try:
        seen = time.monotonic()
        pending._on_pod("ADDED", pod("placed"), None)
        pending._on_pod("ADDED", pod("stuck"), None)
        pending.fleet_changed()  # a fleet change does not explain a pod that has not settled yet
        pending._on_pod("MODIFIED", pod("placed", node="gpu-node-0"), None)  # scheduled at once: leaves the panel
        await asyncio.wait_for(explained.wait(), 5)
        assert time.monotonic() - seen >= SETTLE_S * 0.9
        assert asked == ["stuck"]
        assert pending.pods[("team-a", "stuck")].reason == "no node has a free GPU"
        # a pod already waiting longer than that when first seen (the panel started after it) is explained at once
        explained.clear()
        pending._on_pod("ADDED", pod("old", age_s=60), None)
        await asyncio.wait_for(explained.wait(), SETTLE_S * 0.9)
        assert asked == ["stuck", "old"]
    finally:
        stopping.set()
        await runner
