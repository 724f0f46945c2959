"""`gpu-dra state-gate`: flags -> GateConfig -> the gate, until SIGINT/SIGTERM (services/stategate/gate.py)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import msgspec

from services.stategate.gate import StateGate
from services.stategate.quota import Share
from shared.config import CommonConfig
from shared.runtime import connected_bus, service_main

DESCRIPTION = (
    "State gate: node services reach JetStream only through it; it checks each call against the "
    "node's rights and share, then makes it. Run two or more replicas (one queue group)."
)


class GateConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    node_share_bytes_per_second: Annotated[
        float,
        msgspec.Meta(
            gt=0,
            description=(
                "what one node may store in the shared streams and buckets, per second, once its burst is spent"
            ),
        ),
    ] = 64 * 1024
    node_burst_bytes: Annotated[
        float,
        msgspec.Meta(
            gt=0, description=("what one node may store at once (a start-up inventory, a batch of claim events)")
        ),
    ] = 8 * 1024 * 1024


async def _run(cfg: GateConfig, stopping: asyncio.Event) -> None:
    async with connected_bus(cfg, "state-gate") as bus:
        await StateGate(bus, Share(rate=cfg.node_share_bytes_per_second, burst=cfg.node_burst_bytes)).start()
        await stopping.wait()


def main(argv: list[str] | None = None) -> int:
    return service_main(
        GateConfig, argv, prog="gpu-dra state-gate", description=DESCRIPTION, service=lambda cfg: "state-gate", run=_run
    )
