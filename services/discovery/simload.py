"""Under simulation: the node's claim lifecycle events make the simulated GPUs busy or idle again.

A real GPU is busy because a workload runs on it; a simulated one has no workload, so the claim events of this
node stand in for it: `prepared` marks the devices of the claim busy (by UUID, held by the claim), `unprepared`
and `rolled-back` idle again. Live events only (a core subscription to `dra.v1.claim.*.<node>.*`): after a
discovery restart the devices read idle until their claims change, which is all a simulation needs.
"""

from __future__ import annotations

from services.discovery.nvml import Nvml
from shared.bus import Bus, MsgContext
from shared.events import catalog
from shared.events.claims import ClaimLifecycle

BUSY = {"prepared"}
IDLE = {"unprepared", "rolled-back"}


class SimulatedLoad:
    def __init__(self, node: str, nvml: Nvml) -> None:
        self.node = node
        self.nvml = nvml

    async def subscribe(self, bus: Bus) -> None:
        await bus.subscribe(catalog.CLAIM, self.on_claim, node=self.node)

    async def on_claim(self, event: ClaimLifecycle, ctx: MsgContext) -> None:
        if event.event not in BUSY | IDLE or event.node != self.node:
            return
        uuids = [d.uuid for d in event.devices if d.uuid]
        if uuids:
            await self.nvml.call(self.nvml.set_load, uuids, event.claim_uid, event.event in BUSY)
