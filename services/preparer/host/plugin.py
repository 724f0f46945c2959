"""What a driver plugs into the kubelet-plugin host: the `DriverPlugin` protocol and its `PluginContext`.

The host (`service.PreparerService`) owns what every driver has: its sockets, checkpoint, lifecycle events,
registration, the DRA servicers and stale-claim cleanup. A plugin (`gpu.plugin.GpuPlugin`,
`channel.driver.ChannelPlugin`) brings its claim state machine (a `claimstate.ClaimPreparer` over its
`port.DriverPort`), work to do before the sockets serve, extra gRPC services on its DRA socket, and
background work once NATS is attached.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from services.preparer.config import PreparerConfig
from services.preparer.host.cdi import CdiKind, CdiWriter
from services.preparer.host.checkpoint import Checkpoint
from services.preparer.host.claims import ClaimSource
from services.preparer.host.claimstate import ClaimPreparer
from services.preparer.host.lifecycle import LifecycleEvents
from services.preparer.host.metadatafiles import MetadataFiles
from services.preparer.host.port import DriverPort
from services.preparer.nodesettings import NodeSettings
from shared.bus import Bus


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

    def preparer(self, port: DriverPort, cdi_kind: CdiKind, metadata: MetadataFiles | None = None) -> ClaimPreparer:
        """The driver's claim state machine over `port`, its specs of `cdi_kind` in the CDI dir."""
        cdi = CdiWriter(Path(self.cfg.cdi_dir), cdi_kind, durable=not self.checkpoint.power_loss_is_reboot)
        return ClaimPreparer(
            port=port,
            driver=self.driver,
            node=self.cfg.node,
            claims=self.claims,
            cdi=cdi,
            checkpoint=self.checkpoint,
            events=self.events,
            metadata=metadata,
        )


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
