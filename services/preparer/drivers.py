"""The port between the kubelet-plugin host and one driver: what differs between the drivers a preparer serves.

Owns the `DriverPlugin` protocol and `build()`, which maps a driver name to its plugin. The host
(`service.PreparerService`) owns what every driver has: its sockets, checkpoint, lifecycle events,
registration, the DRA servicers and stale-claim cleanup. A plugin brings its claim preparer (a
`claimstate.ClaimPreparer`), work to do before the sockets serve, extra gRPC services on its DRA
socket, and background work once NATS is attached:
  `gpu.nvidia.com`             -> `gpu.GpuPlugin`       (inventory, discovery device ops, health stream)
  `compute-domain.nvidia.com`  -> `channels.ChannelPlugin` (IMEX channels through the computedomain agent)
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from services.preparer.checkpoint import Checkpoint
from services.preparer.claims import ClaimSource
from services.preparer.claimstate import ClaimPreparer
from services.preparer.config import PreparerConfig
from services.preparer.lifecycle import LifecycleEvents
from services.preparer.nodesettings import NodeSettings
from shared.bus import Bus
from shared.deviceclasses import CD_DRIVER, GPU_DRIVER


@dataclass
class PluginContext:
    """What the host gives a driver plugin: its settings and the host-owned parts it prepares with."""

    cfg: PreparerConfig
    driver: str
    claims: ClaimSource
    plugin_dir: Path
    checkpoint: Checkpoint
    events: LifecycleEvents
    settings: NodeSettings = field(default_factory=NodeSettings)  # the node config of its GPUs


class DriverPlugin(Protocol):
    @property
    def preparer(self) -> ClaimPreparer:
        """The driver's claim state machine, behind the DRA servicers."""

    async def start(self) -> None:
        """Before the sockets serve (the checkpoint is loaded): caches, recovery of interrupted prepares."""

    def add_services(self, server: grpc.aio.Server) -> None:
        """Extra gRPC services on the driver's DRA socket."""

    def attach_bus(self, bus: Bus) -> dict[str, Coroutine[Any, Any, None]]:
        """Use `bus` from now on; returns the background work to run (by task name) until stopped."""


def build(ctx: PluginContext) -> DriverPlugin:
    if ctx.driver == GPU_DRIVER:
        from services.preparer.gpu import GpuPlugin

        return GpuPlugin(ctx)
    if ctx.driver == CD_DRIVER:
        from services.preparer.channeldriver import ChannelPlugin

        return ChannelPlugin(ctx)
    raise ValueError(f"no kubelet plugin for driver {ctx.driver!r}; known: {GPU_DRIVER}, {CD_DRIVER}")
