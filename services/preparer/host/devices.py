"""What the preparer knows of this node's devices, and the device operations it asks of discovery.

Owns the inventory view (discovery's KV value for this node, cached on local disk so that a
restart with NATS down still knows the GPUs, with the device tree as the last fallback for full
GPUs) and the bus calls for time-slicing, MPS and MIG. Device node host paths in CDI are derived here
(the control nodes every claim gets come from `commonedits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from services.preparer.host.checkpoint import atomic_write
from shared.bus import Bus
from shared.events import catalog
from shared.events.devices import (
    MigCreateReply,
    MigCreateRequest,
    MigDestroyReply,
    MigDestroyRequest,
    MpsStartReply,
    MpsStartRequest,
    MpsStopReply,
    MpsStopRequest,
    PartitionActivateReply,
    PartitionActivateRequest,
    PartitionDeactivateReply,
    PartitionDeactivateRequest,
    SetSharingReply,
    SetSharingRequest,
)
from shared.events.inventory import Gpu, MigDevice, MigPlacement, MigProfile, NodeInventory
from shared.logs import get_logger

log = get_logger(__name__)

_GPU_NAME = re.compile(r"^gpu-(\d+)\Z", re.ASCII)
_MIG_NAME = re.compile(r"^gpu-(\d+)-mig-(.+)-(\d+)-(\d+)\Z", re.ASCII)
_VFIO_NAME = re.compile(r"^gpu-vfio-(\d+)\Z", re.ASCII)


class DeviceError(RuntimeError):
    """A device is unknown here or an operation on it failed; the message says which and why."""


@dataclass
class ResolvedDevice:
    """An allocated device name mapped onto this node's hardware."""

    name: str
    kind: str  # gpu | mig | vfio
    gpu: Gpu | None  # the physical GPU (parent for MIG); None when only the device tree knows it
    minor: int
    mig: MigDevice | None = None  # the live MIG device, if it exists
    profile: MigProfile | None = None  # MIG: the profile the name encodes
    placement: MigPlacement | None = None

    @property
    def uuid(self) -> str:
        if self.kind == "mig":
            return self.mig.uuid if self.mig is not None else ""  # a dynamic MIG device has none until created
        return self.gpu.uuid if self.gpu is not None else ""


def device_kind(name: str) -> str:
    """ "gpu" or "mig" from an upstream device name; "" for a name this driver does not publish."""
    if _GPU_NAME.match(name):
        return "gpu"
    if _MIG_NAME.match(name):
        return "mig"
    return ""


class Inventory:
    """The latest NodeInventory for this node, from the bus or the local cache."""

    def __init__(
        self, node: str, cache_path: Path, dev_root: str = "", dev_local: Callable[[str], Path] | None = None
    ) -> None:
        self.node = node
        self.cache_path = Path(cache_path)
        self.dev_root_override = dev_root
        # where this process reads a device node (the host path unless it sees the dev root elsewhere)
        self.dev_local = dev_local or (lambda path: Path(self.host_path(path)))
        self.current: NodeInventory | None = None
        self.live = False  # True once discovery's current value arrived (not just the local cache)
        self.changed = asyncio.Event()

    @property
    def dev_root(self) -> str:
        if self.dev_root_override:
            return self.dev_root_override
        return self.current.dev_root if self.current is not None else "/"

    def _load_sync(self) -> NodeInventory | None:
        try:
            return msgspec.json.decode(self.cache_path.read_bytes(), type=NodeInventory)
        except FileNotFoundError:
            return None
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("inventory cache unreadable; ignoring it", path=str(self.cache_path), error=str(exc))
            return None

    async def load_cache(self) -> None:
        cached = await asyncio.to_thread(self._load_sync)
        if cached is not None and cached.node == self.node and self.current is None:
            self.current = cached
            log.info("inventory loaded from local cache", gpus=len(cached.gpus))

    async def update(self, inventory: NodeInventory, *, live: bool = True) -> None:
        if inventory.node != self.node:
            return
        self.live = self.live or live
        same = self.current is not None and self.current.content_hash == inventory.content_hash != ""
        self.current = inventory
        self.changed.set()
        self.changed = asyncio.Event()
        if not same:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(atomic_write, self.cache_path, msgspec.json.encode(inventory))

    async def wait_live(self, timeout: float) -> bool:
        """Until discovery's current inventory has arrived (False on timeout)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while not self.live:
                    await self.changed.wait()
        return self.live

    def has_mig(self, mig_uuid: str) -> bool:
        inv = self.current
        return inv is not None and any(m.uuid == mig_uuid for g in inv.gpus for m in g.mig_devices)

    async def wait_mig(self, mig_uuid: str, present: bool, timeout: float = 5.0) -> bool:
        """Until the inventory shows (or no longer shows) a MIG device; discovery publishes before it replies."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self.has_mig(mig_uuid) != present:
                    await self.changed.wait()
        return self.has_mig(mig_uuid) == present

    async def watch(self, bus: Bus) -> None:
        """Follow discovery's KV value for this node until cancelled."""
        kv = await bus.kv(catalog.INVENTORY_BUCKET)
        async for key, value in kv.watch(self.node):
            if key == self.node and value is not None:
                await self.update(value)

    async def follow(self, bus: Bus, retry_s: float = 1.0) -> None:
        """`watch`, started again whenever NATS drops it (until cancelled)."""
        while True:
            try:
                await self.watch(bus)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - NATS away: try again
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from exc  # a cleanup error must not swallow our stop
                log.info("inventory watch interrupted; retrying", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(retry_s)

    def host_path(self, container_path: str) -> str:
        root = self.dev_root.rstrip("/")
        return f"{root}{container_path}" if root else container_path

    def resolve(self, name: str) -> ResolvedDevice:
        """Map an allocated device name to hardware here, or raise DeviceError."""
        gpu_m, mig_m, vfio_m = _GPU_NAME.match(name), _MIG_NAME.match(name), _VFIO_NAME.match(name)
        if not gpu_m and not mig_m and not vfio_m:
            raise DeviceError(
                f"device {name!r} is not a device this driver publishes (gpu-<minor>, MIG or gpu-vfio-<minor>)"
            )
        minor = int((gpu_m or mig_m or vfio_m).group(1))  # type: ignore[union-attr]
        inv = self.current
        if vfio_m:  # a passthrough GPU needs its PCI address: discovery's inventory only
            gpu = next((g for g in inv.gpus if g.minor == minor), None) if inv is not None else None
            if gpu is None:
                raise DeviceError(f"device {name} is unknown: no GPU with minor {minor} in discovery's inventory")
            return ResolvedDevice(name=name, kind="vfio", gpu=gpu, minor=minor)
        if inv is None:
            if gpu_m and self.dev_local(f"/dev/nvidia{minor}").exists():
                return ResolvedDevice(name=name, kind="gpu", gpu=None, minor=minor)
            raise DeviceError(
                f"device {name} is unknown: no inventory from discovery yet and "
                f"{self.host_path(f'/dev/nvidia{minor}')} does not exist"
            )
        gpu = next((g for g in inv.gpus if g.minor == minor), None)
        if gpu is None:
            raise DeviceError(f"device {name} is not on node {self.node}: no GPU with minor {minor}")
        if gpu_m:
            return ResolvedDevice(name=name, kind="gpu", gpu=gpu, minor=minor)
        assert mig_m is not None
        live = next((m for m in gpu.mig_devices if m.name == name), None)
        gi_profile, start = int(mig_m.group(3)), int(mig_m.group(4))
        profile = next((p for p in gpu.mig_profiles if p.gi_profile_id == gi_profile), None)
        if live is None and profile is None:
            raise DeviceError(
                f"device {name} is not on node {self.node}: {gpu.name} has no MIG profile id {gi_profile}"
            )
        placement = (
            live.placement
            if live is not None
            else next((p for p in profile.placements if p.start == start), None)
            if profile is not None
            else None
        )
        if live is None and placement is None:
            raise DeviceError(
                f"device {name}: placement start {start} is not valid for profile "
                f"{profile.name if profile else gi_profile} on {gpu.name}"
            )
        return ResolvedDevice(
            name=name, kind="mig", gpu=gpu, minor=minor, mig=live, profile=profile, placement=placement
        )


class DeviceOps:
    """Device operations over the bus (request/reply to discovery on this node)."""

    def __init__(self, node: str, timeout: float = 30.0) -> None:
        self.node = node
        self.timeout = timeout
        self.bus: Bus | None = None

    def _require_bus(self, what: str) -> Any:
        if self.bus is None or not self.bus.connected:
            raise DeviceError(f"{what} needs discovery over NATS, and the bus is not connected; retry when it is")
        return self.bus

    async def _call(self, entry: catalog.Entry, request: Any, what: str) -> Any:
        bus = self._require_bus(what)
        try:
            reply = await bus.request(entry, request, timeout=self.timeout, node=self.node)
        except Exception as exc:  # noqa: BLE001 - BusError and transport errors alike
            raise DeviceError(f"{what}: {exc}") from exc
        if not reply.ok:
            err = reply.error
            raise DeviceError(
                f"{what} refused by discovery ({err.code if err else '?'}): {err.message if err else 'no reason given'}"
            )
        return reply

    async def set_sharing(self, uuids: list[str], compute_mode: str, timeslice: str) -> SetSharingReply:
        return await self._call(  # type: ignore[no-any-return]
            catalog.DEVICE_SET_SHARING,
            SetSharingRequest(
                gpu_uuids=uuids,
                compute_mode=compute_mode,  # type: ignore[arg-type]
                timeslice=timeslice,  # type: ignore[arg-type]
            ),
            f"set time-slice {timeslice} on {len(uuids)} GPU(s)",
        )

    async def mig_create(self, gpu_uuid: str, profile: str, placement: MigPlacement) -> MigCreateReply:
        return await self._call(  # type: ignore[no-any-return]
            catalog.DEVICE_MIG_CREATE,
            MigCreateRequest(gpu_uuid=gpu_uuid, profile=profile, placement=placement),
            f"create MIG {profile} at {placement.start}",
        )

    async def mig_destroy(self, gpu_uuid: str, mig_uuid: str) -> MigDestroyReply:
        return await self._call(  # type: ignore[no-any-return]
            catalog.DEVICE_MIG_DESTROY,
            MigDestroyRequest(gpu_uuid=gpu_uuid, mig_uuid=mig_uuid),
            f"destroy MIG {mig_uuid}",
        )

    async def mps_start(
        self, daemon_id: str, uuids: list[str], pct: int | None, limits: dict[str, int]
    ) -> MpsStartReply:
        return await self._call(  # type: ignore[no-any-return]
            catalog.DEVICE_MPS_START,
            MpsStartRequest(
                daemon_id=daemon_id, gpu_uuids=uuids, active_thread_percentage=pct, pinned_device_memory_limits=limits
            ),
            f"start MPS daemon {daemon_id}",
        )

    async def partition_activate(self, partition_id: int, devices: list[str]) -> PartitionActivateReply:
        return await self._call(  # type: ignore[no-any-return]
            catalog.DEVICE_PARTITION_ACTIVATE,
            PartitionActivateRequest(partition_id=partition_id, devices=devices),
            f"activate NVLink partition {partition_id}",
        )

    async def partition_deactivate(self, partition_id: int) -> PartitionDeactivateReply:
        return await self._call(  # type: ignore[no-any-return]
            catalog.DEVICE_PARTITION_DEACTIVATE,
            PartitionDeactivateRequest(partition_id=partition_id),
            f"deactivate NVLink partition {partition_id}",
        )

    async def mps_stop(self, daemon_id: str) -> MpsStopReply:
        return await self._call(  # type: ignore[no-any-return]
            catalog.DEVICE_MPS_STOP,
            MpsStopRequest(daemon_id=daemon_id),
            f"stop MPS daemon {daemon_id}",
        )
