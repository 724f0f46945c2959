"""A PCI device's driver binding through sysfs: read the binding, unbind, bind with `driver_override`.

Owns the kernel interface VFIO passthrough uses, under a configurable root (`/` on a node, a tree the
simulator or a test made elsewhere): `sys/bus/pci/devices/<bdf>/{driver,iommu_group,driver_override,
vfio-dev}`, `sys/bus/pci/drivers/<driver>/{bind,unbind}`, `sys/module/<module>`. Every call is
blocking file I/O and runs in a worker thread (`asyncio.to_thread`); every write is one `write()` of a
line, opened non-blocking, so a simulated kernel that is not there fails the write instead of hanging.
A bind or unbind is checked by reading the binding back: the kernel applies them before the write
returns; the simulator may take a moment, which `settle_timeout` bounds.
"""

from __future__ import annotations

import errno
import os
import re
import time
from pathlib import Path

BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]\Z")
NVIDIA = "nvidia"
VFIO_PCI = "vfio-pci"
VFIO_MODULE = "vfio_pci"


class PciError(RuntimeError):
    """A sysfs read or write failed, or the kernel did not apply it; the message names the file."""


def normal_bdf(bus_id: str) -> str:
    """NVML's `00000000:1A:00.0` or sysfs' `0000:1a:00.0` -> `0000:1a:00.0`; PciError for anything else."""
    text = bus_id.strip().lower()
    if len(text) == 16 and text.startswith("0000"):  # NVML's 8-digit domain
        text = text[4:]
    if not BDF.match(text):
        raise PciError(f"{bus_id!r} is not a PCI address (dddd:bb:dd.f)")
    return text


class PciSysfs:
    """The PCI part of sysfs under `root` (`root/sys/...`)."""

    def __init__(self, root: str | Path = "/", *, settle_timeout: float = 5.0) -> None:
        self.root = Path(root)
        self.sys = self.root / "sys"
        self.settle_timeout = settle_timeout

    def device_dir(self, bdf: str) -> Path:
        return self.sys / "bus" / "pci" / "devices" / bdf

    def driver_dir(self, driver: str) -> Path:
        return self.sys / "bus" / "pci" / "drivers" / driver

    # -- reads (blocking) ------------------------------------------------------------------
    def driver_of(self, bdf: str) -> str:
        """The bound driver's name, "" when unbound; PciError when the device is not there."""
        dev = self.device_dir(bdf)
        try:
            return os.path.basename(os.readlink(dev / "driver"))
        except FileNotFoundError:
            if not dev.exists():
                raise PciError(f"no PCI device {bdf} under {dev.parent}") from None
            return ""

    def iommu_group(self, bdf: str) -> int:
        """The device's IOMMU group number; PciError without one (IOMMU off in the kernel)."""
        try:
            return int(os.path.basename(os.readlink(self.device_dir(bdf) / "iommu_group")))
        except (OSError, ValueError):
            raise PciError(
                f"PCI device {bdf} has no IOMMU group (is the IOMMU on: intel_iommu=on / amd_iommu=on?)"
            ) from None

    def iommufd_node(self, bdf: str) -> str:
        """`vfioN` when the device has an iommufd character device (bound to vfio-pci with iommufd), else ""."""
        try:
            names = sorted(n for n in os.listdir(self.device_dir(bdf) / "vfio-dev") if n.startswith("vfio"))
        except OSError:
            return ""
        return names[0] if names else ""

    def driver_present(self, driver: str) -> bool:
        return self.driver_dir(driver).is_dir()

    # -- writes (blocking) -----------------------------------------------------------------
    def _write(self, path: Path, text: str) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_TRUNC)
        except OSError as exc:
            why = "nothing serves it (ENXIO)" if exc.errno == errno.ENXIO else exc.strerror
            raise PciError(f"cannot open {path} for writing: {why}") from None
        try:
            os.write(fd, text.encode() + b"\n")
        except OSError as exc:
            raise PciError(f"write of {text!r} to {path} failed: {exc.strerror}") from None
        finally:
            os.close(fd)

    def _settle(self, bdf: str, want: str, what: str) -> None:
        deadline = time.monotonic() + self.settle_timeout
        delay = 0.0005
        while (got := self.driver_of(bdf)) != want:
            if time.monotonic() > deadline:
                raise PciError(
                    f"{what} of {bdf} was not applied: the device is bound to {got or 'no driver'}, "
                    f"expected {want or 'no driver'}"
                )
            time.sleep(delay)  # in a worker thread; sysfs has no change notification
            delay = min(delay * 2, 0.05)

    def unbind(self, bdf: str) -> None:
        """Unbind from whatever driver holds the device (none: nothing to do)."""
        current = self.driver_of(bdf)
        if current:
            self._write(self.driver_dir(current) / "unbind", bdf)
            self._settle(bdf, "", f"unbind from {current}")

    def set_override(self, bdf: str, driver: str) -> None:
        """`driver_override` to `driver` ("" clears it): the only driver the kernel will bind."""
        self._write(self.device_dir(bdf) / "driver_override", driver)

    def bind(self, bdf: str, driver: str) -> None:
        """Bind an unbound device to `driver`, through `driver_override` (vfio-pci has no ID table)."""
        self.set_override(bdf, driver)
        self._write(self.driver_dir(driver) / "bind", bdf)
        self._settle(bdf, driver, f"bind to {driver}")

    def rebind(self, bdf: str, driver: str) -> bool:
        """Move the device to `driver` from wherever it is: each step is skipped when already done, so a
        repeat after a crash at any point finishes the move. True when something was written."""
        current = self.driver_of(bdf)
        if current == driver:
            return False
        if current:
            self.unbind(bdf)
        self.bind(bdf, driver)
        return True
