"""VFIO passthrough of whole GPUs (`gpu-vfio-<minor>`, class `vfio.gpu.nvidia.com`): the GPU moved from
`nvidia` to `vfio-pci` on prepare and given back on undo, and the CDI edits a VM launcher needs.

Owns the steps NVIDIA's driver takes (PassthroughSupport), each one skipped when already done so that
a repeat after a crash at any point finishes the move: wait until no process holds `/dev/nvidia<minor>`,
load `vfio_pci` when its driver is absent, unbind from `nvidia`, set `driver_override`, bind `vfio-pci`;
the way back is the same towards `nvidia`, with `driver_override` cleared last. The checkpoint record
naming the GPU's PCI address is on disk before the first sysfs write (the claim state machine writes it), so
a restart rolls an interrupted move back to `nvidia`. The CDI edits follow NVIDIA's `VfioDeviceConfig`: per device the
IOMMU group node `/dev/vfio/<group>`, or the iommufd node `/dev/vfio/devices/vfioN` with `PreferIommuFD` on a
node that has `/dev/iommu`; the API device (`/dev/vfio/vfio` or `/dev/iommu`) only with `enableAPIDevice`;
no driver userspace, and `NVIDIA_VISIBLE_DEVICES=void`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.preparer.gpu.pcisysfs import NVIDIA, VFIO_MODULE, VFIO_PCI, PciError, PciSysfs, normal_bdf
from services.preparer.host.cdi import ContainerEdits, DeviceNode
from services.preparer.host.devices import DeviceError, ResolvedDevice
from services.preparer.host.port import ClaimRecords
from shared.claimconfigs import VfioDeviceConfig
from shared.logs import get_logger

log = get_logger(__name__)


@dataclass
class VfioSettings:
    sys_root: str = "/"  # where sys/bus/pci lives
    proc_root: str = "/"  # where proc/<pid>/fd lives (the GPU-in-use check)
    modprobe: str = "modprobe"  # run as `<modprobe> vfio_pci` when vfio-pci is absent
    free_timeout: float = 60.0  # seconds to wait for the GPU's processes to go (NVIDIA: 60 s)
    free_interval: float = 1.0  # seconds between looks (NVIDIA: 1 s; there is no event for it)


def passthrough_conflict(records: ClaimRecords, uid: str, resolved: ResolvedDevice) -> str:
    """Why `resolved` cannot be prepared while another claim holds the same GPU the other way; "" if it can.
    The scheduler's shared counters keep this from happening; this is the node's last line of defence."""
    gpu_uuid = resolved.gpu.uuid if resolved.gpu is not None else ""
    if not gpu_uuid:
        return ""
    vfio = resolved.kind == "vfio"
    for _, _, held in records.gpu_holds(gpu_uuid, exclude=uid):
        if (held.kind == "vfio") != vfio:
            return (
                f"its GPU is held by another claim on this node as {held.device}; a GPU is given out "
                "either for passthrough or to the nvidia driver, not both"
            )
    return ""


async def restore_bindings(records: ClaimRecords, passthrough: Passthrough) -> int:
    """At start, after the rollback of interrupted prepares: every GPU of a completed passthrough claim is on
    vfio-pci again (an unprepare killed between its unbind and bind left it on no driver; the kubelet's
    retried unprepare then gives it back from a known state). Returns how many GPUs it moved."""
    moved = 0
    for uid, record in records.by_state("PrepareCompleted").items():
        for dev in record.devices:
            if dev.pci_bus_id and await asyncio.to_thread(passthrough.sysfs.driver_of, dev.pci_bus_id) != VFIO_PCI:
                log.warning(
                    "passthrough GPU of a prepared claim found off vfio-pci; binding it again",
                    claim_uid=uid,
                    device=dev.device,
                    bdf=dev.pci_bus_id,
                )
                await passthrough.acquire(dev.pci_bus_id, int(dev.device.rsplit("-", 1)[1]))
                moved += 1
    return moved


class Passthrough:
    """The node's VFIO moves, through sysfs under `settings.sys_root`."""

    def __init__(self, settings: VfioSettings, host_path: Callable[[str], str]) -> None:
        self.settings = settings
        self.sysfs = PciSysfs(settings.sys_root)
        self.host_path = host_path  # container path -> host path (the node's dev root)
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, bdf: str) -> asyncio.Lock:
        return self._locks.setdefault(bdf, asyncio.Lock())

    @staticmethod
    def address(resolved: ResolvedDevice) -> str:
        if resolved.gpu is None or not resolved.gpu.pci_bus_id:
            raise DeviceError(f"device {resolved.name}: discovery's inventory has no PCI address for its GPU")
        try:
            return normal_bdf(resolved.gpu.pci_bus_id)
        except PciError as exc:
            raise DeviceError(f"device {resolved.name}: {exc}") from None

    async def acquire(self, bdf: str, minor: int) -> int:
        """Bind the GPU to vfio-pci (a no-op when it is there); returns its IOMMU group."""
        async with self._lock(bdf):
            try:
                return await asyncio.to_thread(self._acquire, bdf, minor)
            except PciError as exc:
                raise DeviceError(str(exc)) from None

    def _acquire(self, bdf: str, minor: int) -> int:
        group = self.sysfs.iommu_group(bdf)
        current = self.sysfs.driver_of(bdf)
        if current == VFIO_PCI:
            return group
        if current not in (NVIDIA, ""):
            raise PciError(f"GPU {bdf} is bound to {current!r}; passthrough moves it from {NVIDIA!r} only")
        if current == NVIDIA:
            self._wait_free(bdf, minor)
        self._load_module()
        self.sysfs.rebind(bdf, VFIO_PCI)
        log.info("GPU bound to vfio-pci", bdf=bdf, iommu_group=group, was=current or "unbound")
        return group

    async def release(self, bdf: str) -> None:
        """Give the GPU back to nvidia (a no-op when it is there), `driver_override` cleared."""
        async with self._lock(bdf):
            try:
                await asyncio.to_thread(self._release, bdf)
            except PciError as exc:
                raise DeviceError(str(exc)) from None

    def _release(self, bdf: str) -> None:
        moved = self.sysfs.rebind(bdf, NVIDIA)
        self.sysfs.set_override(bdf, "")
        if moved:
            log.info("GPU given back to nvidia", bdf=bdf)

    def _load_module(self) -> None:
        if self.sysfs.driver_present(VFIO_PCI):
            return
        import subprocess  # noqa: PLC0415 - only on a node that lacks the module

        done = subprocess.run(
            [self.settings.modprobe, VFIO_MODULE], capture_output=True, text=True, timeout=60, check=False
        )
        if done.returncode != 0 or not self.sysfs.driver_present(VFIO_PCI):
            raise PciError(
                f"{self.settings.modprobe} {VFIO_MODULE} did not make the {VFIO_PCI} driver appear "
                f"(exit {done.returncode}: {done.stderr.strip()[-300:]})"
            )

    def _holders(self, minor: int) -> list[int]:
        """PIDs with `/dev/nvidia<minor>` open, from `<proc_root>/proc/<pid>/fd` (what fuser reads)."""
        wanted = {f"/dev/nvidia{minor}", self.host_path(f"/dev/nvidia{minor}")}
        proc = Path(self.settings.proc_root) / "proc"
        pids = []
        try:
            entries = os.listdir(proc)
        except OSError:
            return []
        for name in entries:
            if not name.isdigit():
                continue
            try:
                fds = os.listdir(proc / name / "fd")
            except OSError:
                continue  # gone, or not ours to read
            for fd in fds:
                try:
                    if os.readlink(proc / name / "fd" / fd) in wanted:
                        pids.append(int(name))
                        break
                except OSError:
                    continue
        return pids

    def _wait_free(self, bdf: str, minor: int) -> None:
        deadline = time.monotonic() + self.settings.free_timeout
        while holders := self._holders(minor):
            if time.monotonic() >= deadline:
                raise PciError(
                    f"GPU {bdf} (/dev/nvidia{minor}) is still open by process(es) {sorted(holders)[:10]} "
                    f"after {self.settings.free_timeout:g}s; it is not moved to vfio-pci while in use"
                )
            time.sleep(self.settings.free_interval)  # in a worker thread: fuser-style polling, as NVIDIA's

    # -- CDI ---------------------------------------------------------------------------------
    def _iommufd(self, config: VfioDeviceConfig) -> bool:
        prefer = config.iommu is not None and config.iommu.backendPolicy == "PreferIommuFD"
        return prefer and Path(self.host_path("/dev/iommu")).exists()

    def device_nodes(self, bdf: str, group: int, config: VfioDeviceConfig) -> list[DeviceNode]:
        if self._iommufd(config):
            cdev = self.sysfs.iommufd_node(bdf)
            if not cdev:
                raise DeviceError(
                    f"GPU {bdf} has no iommufd device (sys/bus/pci/devices/{bdf}/vfio-dev) although "
                    "the node has /dev/iommu; use backendPolicy LegacyOnly"
                )
            path = f"/dev/vfio/devices/{cdev}"
        else:
            path = f"/dev/vfio/{group}"
        return [DeviceNode(path, self.host_path(path))]

    def common_edits(self, config: VfioDeviceConfig) -> ContainerEdits:
        edits = ContainerEdits(env=["NVIDIA_VISIBLE_DEVICES=void"])
        if config.iommu is not None and config.iommu.enableAPIDevice:
            path = "/dev/iommu" if self._iommufd(config) else "/dev/vfio/vfio"
            edits.nodes.append(DeviceNode(path, self.host_path(path)))
        return edits
