"""The PCI side of a simulated node's kernel: a sysfs tree for its GPUs and a thread that binds and unbinds.

Owns, under a node root: `sys/bus/pci/devices/<bdf>` (`driver`, `iommu_group`, `driver_override`,
`vfio-dev/vfioN` while on vfio-pci), `sys/bus/pci/drivers/{nvidia,vfio-pci}/{bind,unbind}`,
`sys/kernel/iommu_groups/<n>`, `sys/module/{nvidia,vfio_pci}` and `dev/vfio/{vfio,<group>,devices/vfioN}`.
The bind and unbind files are FIFOs that `PciKernel` (one thread) reads; it applies each written line as
the kernel does: unbind drops the `driver` link, bind links the device to the driver when it is unbound
and `driver_override` is empty or names the driver (vfio-pci has no ID table, so only the override lets
it bind), and a vfio-pci binding brings the group's and the iommufd device's nodes. The preparer writes
these files as it writes a real node's; `hook` lets a test stop the "kernel" at an operation.
"""

from __future__ import annotations

import os
import selectors
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.logs import get_logger

log = get_logger(__name__)
DRIVERS = ("nvidia", "vfio-pci")
MODULES = ("nvidia", "vfio_pci")
IOMMU_GROUP_BASE = 20  # a simulated GPU's IOMMU group is 20 + its minor


@dataclass(frozen=True)
class PciOp:
    op: str  # bind | unbind
    driver: str
    bdf: str


def _link(link: Path, target: Path) -> None:
    rel = os.path.relpath(target, link.parent)
    if link.is_symlink() and os.readlink(link) == rel:
        return
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(rel)


def _fifo(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not path.is_fifo():
        path.unlink()
    if not path.exists():
        os.mkfifo(path)


def ensure_tree(root: Path, *, modules: tuple[str, ...] = MODULES) -> None:
    """The drivers' bind/unbind FIFOs, the loaded modules' dirs and `/dev/vfio/vfio` (idempotent)."""
    for driver in DRIVERS:
        module = driver.replace("-", "_")
        if module in modules:
            (root / "sys" / "module" / module).mkdir(parents=True, exist_ok=True)
            for name in ("bind", "unbind"):
                _fifo(root / "sys" / "bus" / "pci" / "drivers" / driver / name)
    (root / "dev" / "vfio").mkdir(parents=True, exist_ok=True)
    (root / "dev" / "vfio" / "vfio").touch(exist_ok=True)


def ensure_device(root: Path, device_dir: Path, bdf: str, group: int) -> None:
    """A PCI device at `device_dir` (already linked from sys/bus/pci/devices) in IOMMU group `group`, bound
    to nvidia when first made; later calls leave its binding as the kernel left it."""
    groups = root / "sys" / "kernel" / "iommu_groups" / str(group)
    (groups / "devices").mkdir(parents=True, exist_ok=True)
    _link(groups / "devices" / bdf, device_dir)
    _link(device_dir / "iommu_group", groups)
    override = device_dir / "driver_override"
    if not override.exists():
        _link(device_dir / "driver", root / "sys" / "bus" / "pci" / "drivers" / "nvidia")
        override.write_text("")


class PciKernel:
    """One thread applying bind/unbind writes under `root`. `hook(op)` runs before each operation (in the
    kernel's thread); it may block, and returning False drops the operation (as if never written)."""

    def __init__(self, root: Path, hook: Callable[[PciOp], bool] | None = None) -> None:
        self.root = Path(root)
        self.hook = hook
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self.applied: list[PciOp] = []
        self._fds: dict[int, PciOp] = {}

    def start(self) -> PciKernel:
        """Opens the FIFOs before it returns: from then on a write finds its reader."""
        ensure_tree(self.root)
        for driver in DRIVERS:
            for op in ("bind", "unbind"):
                path = self.root / "sys" / "bus" / "pci" / "drivers" / driver / op
                if path.is_fifo():  # opened read-write: it always has a reader, and never reads EOF
                    self._fds[os.open(path, os.O_RDWR | os.O_NONBLOCK)] = PciOp(op, driver, "")
        self._thread = threading.Thread(target=self._run, name=f"sim-pci-kernel:{self.root}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        for fd, kind in self._fds.items():
            sel.register(fd, selectors.EVENT_READ, kind)
        pending: dict[int, bytes] = {}
        try:
            while not self._stop.is_set():
                for key, _ in sel.select():
                    if key.data is None:
                        continue
                    fd = key.fd
                    assert isinstance(fd, int)
                    data = pending.pop(fd, b"") + os.read(fd, 4096)
                    *lines, rest = data.split(b"\n")
                    if rest:
                        pending[fd] = rest
                    for line in lines:
                        self._apply(PciOp(key.data.op, key.data.driver, line.decode().strip()))
        finally:
            sel.close()
            for fd in self._fds:
                os.close(fd)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _apply(self, op: PciOp) -> None:
        if self.hook is not None and not self.hook(op):
            log.info("sim PCI kernel dropped an operation", op=op.op, driver=op.driver, bdf=op.bdf)
            return
        dev = self.root / "sys" / "bus" / "pci" / "devices" / op.bdf
        if not dev.exists():
            log.warning("sim PCI kernel: no such device", op=op.op, bdf=op.bdf)
            return
        dev = dev.resolve()
        current = os.path.basename(os.readlink(dev / "driver")) if (dev / "driver").is_symlink() else ""
        if op.op == "unbind":
            if current == op.driver:  # the nodes change before the link: whoever sees the link sees them
                if op.driver == "vfio-pci":
                    self._vfio_nodes(dev, present=False)
                (dev / "driver").unlink()
        elif not current:
            override = (dev / "driver_override").read_text().strip()
            if override in ("", op.driver) and not (op.driver == "vfio-pci" and not override):
                if op.driver == "vfio-pci":
                    self._vfio_nodes(dev, present=True)
                _link(dev / "driver", self.root / "sys" / "bus" / "pci" / "drivers" / op.driver)
        self.applied.append(op)

    def _vfio_nodes(self, dev: Path, *, present: bool) -> None:
        group = os.path.basename(os.readlink(dev / "iommu_group"))
        cdev = f"vfio{int(group) - IOMMU_GROUP_BASE}" if group.isdigit() else "vfio0"
        nodes = [
            self.root / "dev" / "vfio" / group,
            self.root / "dev" / "vfio" / "devices" / cdev,
            dev / "vfio-dev" / cdev,
        ]
        for node in nodes:
            if present:
                node.parent.mkdir(parents=True, exist_ok=True)
                node.touch(exist_ok=True)
            else:
                node.unlink(missing_ok=True)


_SERVED: dict[Path, PciKernel] = {}
_SERVED_LOCK = threading.Lock()


def serve(root: Path) -> PciKernel:
    """The one kernel thread of a simulated node root in this process (started on first use)."""
    key = Path(root).resolve()
    with _SERVED_LOCK:
        kernel = _SERVED.get(key)
        if kernel is None:
            kernel = _SERVED[key] = PciKernel(key).start()
        return kernel
