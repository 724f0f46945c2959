"""The kubelet emulator's plugin watcher: register every DRA plugin whose socket appears in the registry dir.

Owns scanning `<registry-dir>/*-reg.sock` (the kubelet's plugin watcher does the same with fsnotify),
registering each new socket through the real registration protocol, dropping plugins whose socket
went away or was replaced, following each registered plugin's device health stream (`resourcehealth.py`), and
routing prepare/unprepare calls to the driver's plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from embedded.kubelet.client import Claim, DraPlugin, PluginError, PreparedClaim, register
from embedded.nodeagent.resourcehealth import DeviceHealthCache, follow
from shared.logs import get_logger
from shared.tasks import cancel_and_wait

log = get_logger(__name__)
SCAN_INTERVAL = 0.25


class PluginRegistry:
    """Registered DRA plugins by driver name; `changed` is set whenever the set changes."""

    def __init__(self, registry_dir: Path):
        self.registry_dir = registry_dir
        self.plugins: dict[str, DraPlugin] = {}
        self._sockets: dict[Path, tuple[int, str]] = {}  # socket -> (inode, driver)
        self.changed = asyncio.Event()
        self.health = DeviceHealthCache()
        self._health_streams: dict[str, asyncio.Task[None]] = {}  # driver -> its health stream's follower

    def drivers(self) -> set[str]:
        return set(self.plugins)

    async def prepare(self, driver: str, claims: list[Claim]) -> dict[str, PreparedClaim]:
        plugin = self.plugins.get(driver)
        if plugin is None:
            raise PluginError(f"driver {driver} is not registered (no socket in {self.registry_dir})")
        return await plugin.prepare(claims)

    async def unprepare(self, driver: str, claims: list[Claim]) -> dict[str, str]:
        plugin = self.plugins.get(driver)
        if plugin is None:
            return {c.uid: f"driver {driver} is not registered" for c in claims}
        return await plugin.unprepare(claims)

    async def scan(self) -> None:
        present: dict[Path, int] = {}
        with contextlib.suppress(FileNotFoundError):
            for path in self.registry_dir.glob("*-reg.sock"):
                with contextlib.suppress(FileNotFoundError):
                    present[path] = path.stat().st_ino
        for path, (inode, driver) in list(self._sockets.items()):
            if present.get(path) != inode:
                del self._sockets[path]
                await self._drop(driver)
                log.info("plugin deregistered", driver=driver, socket=str(path))
                self.changed.set()
        for path, inode in present.items():
            if path in self._sockets:
                continue
            try:
                plugin = await register(path)
            except PluginError as exc:
                log.warning("plugin registration failed; will retry", socket=str(path), error=str(exc))
                continue
            await self._drop(plugin.driver)
            self.plugins[plugin.driver] = plugin
            self._health_streams[plugin.driver] = asyncio.create_task(follow(plugin, self.health))
            self._sockets[path] = (inode, plugin.driver)
            log.info("plugin registered", driver=plugin.driver, version=plugin.version, endpoint=plugin.endpoint)
            self.changed.set()

    async def _drop(self, driver: str) -> None:
        stream = self._health_streams.pop(driver, None)
        if stream is not None:
            await cancel_and_wait([stream])
        plugin = self.plugins.pop(driver, None)
        if plugin is not None:
            await plugin.close()

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            await self.scan()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), SCAN_INTERVAL)

    async def close(self) -> None:
        for driver in list(self.plugins):
            await self._drop(driver)
