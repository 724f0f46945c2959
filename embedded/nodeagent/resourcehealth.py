"""The kubelet's DRA device health (KEP-4680, kubelet 1.34): plugins' health streams in, `allocatedResourcesStatus` out.

Owns the health cache (driver -> pool/device -> health, as the kubelet's `healthInfoCache`: a device not reported,
or not reported within its timeout, is Unknown; a driver whose stream ended is forgotten), following one plugin's
`NodeWatchResources` stream into it (again after a broken stream, with backoff; not at all when the plugin serves
none), and the container statuses' `allocatedResourcesStatus` built from it as upstream's
`dra.Manager.UpdateAllocatedResourcesStatus` builds them: per container claim reference one entry named
`claim:<name>` or `claim:<name>/<request>` (the pod's claim reference name), listing every device prepared for
that claim with `resourceID` the device's first CDI id (`<driver>/<pool>/<device>` when it has none) and its
health. Unlike 1.34, a claim named directly by `resourceClaimName` is covered too (upstream finds claim names
only in `status.resourceClaimStatuses`, which lists the claims made from templates).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from embedded.kubelet.client import DeviceHealthReport, DraPlugin, PreparedDevice
from shared.backoff import Backoff
from shared.logs import get_logger

log = get_logger(__name__)
DEFAULT_TIMEOUT_S = 30.0  # upstream's DefaultHealthTimeout: a device not reported for this long is Unknown
DeviceKey = tuple[str, str, str]  # (driver, pool, device)


@dataclass(frozen=True)
class _Entry:
    health: str
    seen: float  # monotonic
    timeout_s: float


class DeviceHealthCache:
    """Latest health per driver/pool/device; `on_change(keys)` hears of every device whose health changed."""

    def __init__(self) -> None:
        self.devices: dict[DeviceKey, _Entry] = {}
        self.on_change: Callable[[set[DeviceKey]], None] | None = None

    def health(self, driver: str, pool: str, device: str) -> str:
        entry = self.devices.get((driver, pool, device))
        if entry is None or time.monotonic() - entry.seen > entry.timeout_s:
            return "Unknown"
        return entry.health

    def update(self, driver: str, reports: Iterable[DeviceHealthReport]) -> set[DeviceKey]:
        now = time.monotonic()
        changed: set[DeviceKey] = set()
        for report in reports:
            key = (driver, report.pool, report.device)
            if self.health(*key) != report.health:
                changed.add(key)
            self.devices[key] = _Entry(report.health, now, report.timeout_s or DEFAULT_TIMEOUT_S)
        self._tell(changed)
        return changed

    def clear_driver(self, driver: str) -> None:
        gone = {key for key in self.devices if key[0] == driver}
        for key in gone:
            del self.devices[key]
        self._tell(gone)

    def _tell(self, changed: set[DeviceKey]) -> None:
        if changed and self.on_change is not None:
            self.on_change(changed)


async def follow(plugin: DraPlugin, cache: DeviceHealthCache) -> None:
    """Feed `plugin`'s health stream into `cache` until cancelled (or the plugin has none); the driver's
    devices are forgotten whenever its stream ends, as the kubelet's `clearDriver`."""
    backoff = Backoff(initial_s=0.5, cap_s=10.0)
    while True:
        started = time.monotonic()
        try:
            async for reports in plugin.watch_health():
                cache.update(plugin.driver, reports)
                backoff.reset()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("plugin serves no device health stream", driver=plugin.driver)
                return
            log.warning(
                "device health stream broke; following again",
                driver=plugin.driver,
                error=f"{exc.code().name}: {exc.details()}",
            )
        finally:
            cache.clear_driver(plugin.driver)
        backoff.ran(time.monotonic() - started)
        await asyncio.sleep(backoff.next())


def resource_id(driver: str, device: PreparedDevice) -> str:
    return device.cdi_device_ids[0] if device.cdi_device_ids else f"{driver}/{device.pool}/{device.device}"


def allocated_resources_status(
    pod: dict[str, Any],
    claim_names: dict[str, str],
    devices_of: Callable[[str], list[tuple[str, PreparedDevice]]],
    cache: DeviceHealthCache,
) -> dict[str, list[dict[str, Any]]]:
    """Container name -> its `allocatedResourcesStatus`. `claim_names`: the pod's claim reference name -> the
    ResourceClaim's name; `devices_of(claim name)`: the (driver, device) pairs prepared for it."""
    out: dict[str, list[dict[str, Any]]] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        entries: dict[str, dict[str, Any]] = {}
        for ref in (container.get("resources") or {}).get("claims") or []:
            claim = claim_names.get(ref.get("name", ""))
            devices = devices_of(claim) if claim else []
            if not devices:
                continue
            name = f"claim:{ref['name']}" + (f"/{ref['request']}" if ref.get("request") else "")
            entries[name] = {
                "name": name,
                "resources": [
                    {"resourceID": resource_id(driver, d), "health": cache.health(driver, d.pool, d.device)}
                    for driver, d in devices
                ],
            }
        if entries:
            out[container["name"]] = list(entries.values())
    return out
