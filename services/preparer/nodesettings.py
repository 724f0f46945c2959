"""This node's GPUs' NodeConfig settings, as the preparer reads them when it prepares a claim.

Owns the node's labels (its Node object, watched by name) and the config they select from: the
cluster's NodeConfig objects (`shared.nodeconfig_objects`, the same merge and precedence as the
publisher's), or the `--node-config` file the publisher is given too. A GPU's setting is resolved
when a claim on it is prepared (`shared.nodeconfig.setting_for`), so a change applies to the next
prepare and never to a claim already prepared. Without an API server (tests), or before the first
list, every GPU has the built-in default (exclusive).
"""

from __future__ import annotations

import asyncio
from typing import Any

from shared import nodeconfig
from shared.events.inventory import Gpu
from shared.kube.informer import Informer
from shared.kube.resources import NODES, Kube
from shared.logs import get_logger
from shared.nodeconfig_objects import NodeConfigObjects

log = get_logger(__name__)
SYNC_WAIT_S = 5.0


class NodeSettings:
    """A fixed config and node labels (a `--node-config` file, or none)."""

    def __init__(
        self, config: nodeconfig.NodeConfig = nodeconfig.DEFAULT, labels: dict[str, str] | None = None
    ) -> None:
        self._config = config
        self._labels = labels or {}

    @property
    def config(self) -> nodeconfig.NodeConfig:
        return self._config

    @property
    def labels(self) -> dict[str, str]:
        return self._labels

    def setting(self, gpu: Gpu) -> nodeconfig.GpuSetting:
        config = self.config
        if not config.spec.rules:
            return nodeconfig.GpuSetting(gpu=gpu.name)
        return nodeconfig.setting_for(config, self.labels, gpu)

    async def synced(self) -> None:
        """Until the settings have been read once (at once here)."""

    async def run(self, stopping: asyncio.Event) -> None:
        """Nothing to follow."""


class KubeNodeSettings(NodeSettings):
    """The NodeConfig objects and this node's labels, followed live (`run`); a file, when given, instead of
    the objects (its labels are still the Node's)."""

    def __init__(self, api_client: Any, node: str, *, file_config: nodeconfig.NodeConfig | None = None) -> None:
        super().__init__(file_config or nodeconfig.DEFAULT)
        self.objects = None if file_config is not None else NodeConfigObjects(api_client, who="the preparer")
        self.node = Informer(Kube(api_client), NODES, field_selector=f"metadata.name={node}", retry_s=5.0)
        self.node_name = node
        self._synced = False

    @property
    def config(self) -> nodeconfig.NodeConfig:
        return self.objects.config if self.objects is not None else self._config

    async def synced(self) -> None:
        """Until the Node and the objects have been listed once, or SYNC_WAIT_S at most, once: a prepare right
        after a start uses the node's rules, not the default; an API server that cannot answer (or a role that
        may not read them) delays the first such prepare only (the GPUs are exclusive until they are read)."""
        if self._synced:
            return
        waits = [self.node.synced.wait()] + ([self.objects.ready.wait()] if self.objects is not None else [])
        try:
            async with asyncio.timeout(SYNC_WAIT_S):
                await asyncio.gather(*waits)
        except TimeoutError:
            log.warning(
                "node config not read yet; preparing with every GPU exclusive until it is",
                node=self.node_name,
                waited_s=SYNC_WAIT_S,
            )
        self._synced = True

    @property
    def labels(self) -> dict[str, str]:
        obj = self.node.get("", self.node_name)
        return dict(((obj or {}).get("metadata") or {}).get("labels") or {})

    async def run(self, stopping: asyncio.Event) -> None:
        work = [self.node.run(stopping)] + ([self.objects.run(stopping)] if self.objects is not None else [])
        await asyncio.gather(*work)
