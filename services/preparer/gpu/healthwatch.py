"""Device health for the kubelet (`v1alpha1.DRAResourceHealth/NodeWatchResources`), from discovery's events.

Owns the per-device health view for this node (KV `dra-health` at start, then live
`dra.v1.health.<node>.*` events, and KV again after a NATS reconnect, since a core subscription
misses what was published meanwhile) and the stream: each message is the complete device list of
the driver's pool, sent on every change and at least every `resend_s` so that no device times out.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.preparer.host.devices import Inventory
from services.preparer.protos import dra_health_v1alpha1_pb2 as health_pb2
from services.preparer.protos import dra_health_v1alpha1_pb2_grpc as health_grpc
from shared.backoff import Backoff
from shared.bus import Bus
from shared.events import catalog
from shared.events.health import DeviceHealth
from shared.logs import get_logger

log = get_logger(__name__)

_STATUS = {"Healthy": health_pb2.HEALTHY, "Unhealthy": health_pb2.UNHEALTHY, "Unknown": health_pb2.UNKNOWN}


class HealthWatch(health_grpc.DRAResourceHealthServicer):
    def __init__(self, node: str, inventory: Inventory, pool: str = "", resend_s: float = 10.0) -> None:
        self.node = node
        self.pool = pool or node
        self.inventory = inventory
        self.resend_s = resend_s
        self.states: dict[str, DeviceHealth] = {}
        # set (and replaced) on every change: each stream waits on the one it took before its snapshot,
        # so neither a change during a send nor another stream's wait can swallow a wake-up
        self.changed = asyncio.Event()
        self._rereading: asyncio.Task[None] | None = None  # the KV re-read after a reconnect, while it runs

    def _note(self, health: DeviceHealth) -> None:
        if health.node == self.node and self.states.get(health.device) != health:
            self.states[health.device] = health
            self.changed.set()
            self.changed = asyncio.Event()

    async def watch(self, bus: Bus) -> None:
        kv = await bus.kv(catalog.HEALTH_BUCKET)
        self._note_all(await kv.items(f"{self.node}.>"))

        async def on_event(message: DeviceHealth, _ctx: Any) -> None:
            self._note(message)

        await bus.subscribe(catalog.HEALTH, on_event, node=self.node)
        bus.on_reconnect(lambda: self._reread(bus, kv))

    def _reread(self, bus: Bus, kv: Any) -> None:
        """After a reconnect: one re-read of KV at a time; one under way reads after this reconnect anyway."""
        if self._rereading is None or self._rereading.done():
            self._rereading = bus.spawn(self._read_kv(kv))

    async def _read_kv(self, kv: Any) -> None:
        """Read this node's health from KV until a read succeeds: what was missed while NATS was away is only
        there (a server just restarted may not serve the bucket yet), and no later event need ever come."""
        backoff = Backoff(initial_s=0.2, cap_s=5.0)
        while True:
            try:
                stored = await kv.items(f"{self.node}.>")
                self._note_all(stored)
                unhealthy = sorted(v.device for v in stored.values() if v.state != "Healthy")
                log.info("device health re-read from KV after a reconnect", node=self.node, unhealthy=unhealthy)
                return
            except Exception as exc:  # noqa: BLE001 - retried: the stream goes on with what it has meanwhile
                delay = backoff.next()
                log.warning(
                    "device health not re-read from KV after a reconnect; retrying",
                    node=self.node,
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=delay,
                )
                await asyncio.sleep(delay)

    def _note_all(self, stored: dict[str, DeviceHealth]) -> None:
        for key, value in stored.items():
            if key.startswith(f"{self.node}."):
                self._note(value)

    def snapshot(self) -> health_pb2.NodeWatchResourcesResponse:
        names: list[str] = []
        inv = self.inventory.current
        for gpu in inv.gpus if inv is not None else []:
            names.append(gpu.name)
            names += [m.name for m in gpu.mig_devices]
        now = int(time.time())
        out = health_pb2.NodeWatchResourcesResponse()
        for name in names:
            state = self.states.get(name)
            out.devices.append(
                health_pb2.DeviceHealth(
                    device=health_pb2.DeviceIdentifier(pool_name=self.pool, device_name=name),
                    health=_STATUS[state.state] if state else health_pb2.HEALTHY,
                    last_updated_time=now,
                    message=(state.message or state.reason)[:1024] if state else "",
                )
            )
        return out

    async def NodeWatchResources(self, request: Any, context: Any):  # type: ignore[no-untyped-def]  # noqa: N802
        while True:
            health_changed, inventory_changed = self.changed, self.inventory.changed
            yield self.snapshot()
            waits = [asyncio.ensure_future(health_changed.wait()), asyncio.ensure_future(inventory_changed.wait())]
            try:
                await asyncio.wait(waits, timeout=self.resend_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()


def add_health_service(server: Any, watch: HealthWatch) -> None:
    health_grpc.add_DRAResourceHealthServicer_to_server(watch, server)
