"""Device health from NVML events: XID and GPU-lost become DeviceHealth events and KV state.

Owns the event-wait thread, the ignore list (reference default 13, 31, 43, 45, 68, 109), mapping
(UUID, GI, CI) to device names, and de-duplication: a device's last state lives in KV
`dra-health` under `<node>.<device>`; only a change publishes, so restarts neither lose nor repeat it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

from services.discovery import healthmetrics
from services.discovery.nvml import NO_ID, GpuLost, Nvml, RawEvent
from shared.bus import Bus
from shared.events import catalog
from shared.events.health import DeviceHealth
from shared.events.inventory import NodeInventory
from shared.logs import get_logger

log = get_logger(__name__)
XID_EVENTS = Counter("gpu_dra_xid_events", "XID errors that changed a device's health, by XID code", ["node", "xid"])


class HealthMonitor:
    def __init__(
        self,
        node: str,
        nvml: Nvml,
        bus: Bus,
        ignored: set[int],
        inventory: Callable[[], NodeInventory | None],
        on_event: Callable[[], None] | None = None,
        timeout_ms: int = 1000,
    ):
        self.node = node
        self.nvml = nvml
        self.bus = bus
        self.kv: Any = None
        self.ignored = set(ignored)
        self._inventory = inventory
        self._on_event = on_event
        self._timeout_ms = timeout_ms
        self.last: dict[str, DeviceHealth] = {}
        self._queue: asyncio.Queue[RawEvent | GpuLost] = asyncio.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._es: Any = None
        self._lock = asyncio.Lock()
        healthmetrics.DEVICE_HEALTH.track(node, self)  # gpu_dra_device_healthy, counted when scraped

    def inventory(self) -> NodeInventory | None:
        return self._inventory()

    async def start(self) -> None:
        self.kv = await self.bus.kv(catalog.HEALTH_BUCKET)
        prefix = f"{self.node}."
        for key in await self.kv.keys(f"{self.node}.>"):  # only its own keys: all its user may read
            if key.startswith(prefix):
                value = await self.kv.get(key)
                if value is not None:
                    self.last[value.device] = value
        self._es, unmonitored = await self.nvml.call(self.nvml.open_events)
        if unmonitored:
            log.warning("GPUs not monitored for health events", node=self.node, uuids=",".join(unmonitored))
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._wait_loop, args=(loop,), name="nvml-events", daemon=True)
        self._thread.start()
        self._task = asyncio.create_task(self._consume())

    def _wait_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.is_set():
            try:
                ev = self.nvml.wait_event(self._es, self._timeout_ms)
            except GpuLost as exc:
                loop.call_soon_threadsafe(self._queue.put_nowait, exc)
                self._stop.wait(5.0)
                continue
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("NVML event wait failed; retrying", error=str(exc))
                self._stop.wait(1.0)
                continue
            if ev is not None:
                loop.call_soon_threadsafe(self._queue.put_nowait, ev)

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, self._timeout_ms / 1000 + 2)
        if self._es is not None:
            await self.nvml.call(self.nvml.close_events, self._es)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _consume(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                if isinstance(item, GpuLost):
                    await self.gpu_lost_all(str(item))
                else:
                    await self.handle(item)
            except Exception as exc:  # one bad event must not stop health monitoring
                log.exception("health event handling failed", error=str(exc))
            if self._on_event is not None:
                self._on_event()

    # ------------------------------------------------------------------ mapping
    def _devices_for(self, uuid: str, gi: int, ci: int) -> list[tuple[str, str]]:
        """[(device name, uuid)] an event refers to; a MIG UUID or (GPU UUID, GI, CI) both work."""
        inv = self._inventory()
        if inv is None:
            return []
        for g in inv.gpus:
            if g.uuid == uuid:
                if gi == NO_ID:
                    return [(g.name, g.uuid)]
                for m in g.mig_devices:
                    if m.gpu_instance_id == gi and m.compute_instance_id == ci:
                        return [(m.name, m.uuid)]
                return []
            for m in g.mig_devices:
                if m.uuid == uuid:
                    return [(m.name, m.uuid)]
        return []

    def _with_children(self, uuid: str) -> list[tuple[str, str]]:
        inv = self._inventory()
        for g in inv.gpus if inv else []:
            if g.uuid == uuid:
                return [(g.name, g.uuid)] + [(m.name, m.uuid) for m in g.mig_devices]
        return self._devices_for(uuid, NO_ID, NO_ID)

    # ------------------------------------------------------------------ events
    async def handle(self, ev: RawEvent) -> int:
        """Turn one NVML event into health events; returns how many were published."""
        if ev.is_gpu_lost:
            return await self._set_many(
                self._with_children(ev.gpu_uuid), "Unhealthy", "gpu-lost", 0, "GPU fell off the bus or is unavailable"
            )
        if not ev.is_xid:
            log.debug("ignoring non-XID NVML event", type=hex(ev.event_type), uuid=ev.gpu_uuid)
            return 0
        if ev.data in self.ignored:
            log.info("ignored XID", node=self.node, uuid=ev.gpu_uuid, xid=ev.data)
            return 0
        devices = self._devices_for(ev.gpu_uuid, ev.gi_id, ev.ci_id)
        if not devices:
            log.warning("XID for an unknown device", uuid=ev.gpu_uuid, gi=ev.gi_id, ci=ev.ci_id, xid=ev.data)
            return 0
        return await self._set_many(devices, "Unhealthy", "xid", ev.data, f"XID {ev.data}")

    async def gpu_lost_all(self, message: str) -> int:
        inv = self._inventory()
        devices = [
            pair
            for g in (inv.gpus if inv else [])
            for pair in [(g.name, g.uuid), *((m.name, m.uuid) for m in g.mig_devices)]
        ]
        return await self._set_many(devices, "Unhealthy", "gpu-lost", 0, message)

    async def recover(self, uuid: str) -> int:
        return await self._set_many(self._with_children(uuid), "Healthy", "recovered", 0, "marked healthy")

    async def _set_many(self, devices: list[tuple[str, str]], state: str, reason: str, xid: int, message: str) -> int:
        n = 0
        for name, uuid in devices:
            n += await self._set(name, uuid, state, reason, xid, message)
        return n

    async def _set(self, device: str, uuid: str, state: str, reason: str, xid: int, message: str) -> int:
        async with self._lock:
            prev = self.last.get(device)
            if prev is None and state == "Healthy":
                return 0  # never reported unhealthy: nothing to recover
            if prev is not None and (prev.state, prev.reason, prev.xid) == (state, reason, xid):
                return 0  # no change (repeat of the same XID, or a replay after restart)
            now = time.time()
            event_id = f"{self.node}.{device}.{reason}.{xid}.{int(now * 1000)}"
            h = DeviceHealth(
                node=self.node,
                device=device,
                uuid=uuid,
                state=state,  # type: ignore[arg-type]
                reason=reason,
                xid=xid,
                message=message,
                event_id=event_id,
                observed_at=now,
            )
            await self.kv.put(f"{self.node}.{device}", h)
            await self.bus.publish(catalog.HEALTH, h, msg_id=event_id, node=self.node, device=device)
            self.last[device] = h
            if reason == "xid" and xid:
                XID_EVENTS.labels(self.node, str(xid)).inc()
            log.info("device health changed", node=self.node, device=device, state=state, reason=reason, xid=xid)
            return 1
