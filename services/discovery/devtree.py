"""The fake device tree a simulated node exposes under `--dev-root DIR`.

Owns writing `DIR/dev/nvidia*`, `DIR/dev/nvidia-caps/nvidia-capN`, `DIR/proc/devices`,
`DIR/proc/driver/nvidia-caps/mig-minors` and a minimal `DIR/sys/bus/pci/devices/<bdf>` (with
`numa_node`, linked under its PCIe root, and the driver binding `simpci` keeps) so the code that reads them is the code
used on real nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from services.discovery import simpci

FRONTEND_MAJOR = 195
UVM_MAJOR = 510
CAPS_MAJOR = 237
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
_GI_PER_GPU = 15
_CI_PER_GI = 8


def mig_cap_minors(gpu_minor: int, gi: int, ci: int) -> tuple[int, int]:
    """The nvidia-caps minors of a MIG device's GI and CI access files (the driver's mig-minors layout)."""
    gi_access = 3 + gpu_minor * _GI_PER_GPU * (1 + _CI_PER_GI) + gi * (1 + _CI_PER_GI)
    return gi_access, gi_access + 1 + ci


@dataclass
class DevGpu:
    minor: int
    bus_id: str  # 0000:1a:00.0
    pcie_root: str  # pci0000:00
    numa_node: int
    mig: list[tuple[int, int]] = field(default_factory=list)  # live (gi, ci)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def sync(root: Path, gpus: list[DevGpu]) -> None:
    """Make the tree under `root` match `gpus` (idempotent; stale GPU and cap files are removed)."""
    dev = root / "dev"
    caps = dev / "nvidia-caps"
    caps.mkdir(parents=True, exist_ok=True)
    want_dev = {f"nvidia{g.minor}" for g in gpus} | set(CONTROL_DEVICES)
    for name in want_dev:
        (dev / name).touch(exist_ok=True)
    for p in dev.glob("nvidia[0-9]*"):
        if p.name not in want_dev:
            p.unlink()
    want_caps = {"nvidia-cap1", "nvidia-cap2"}  # mig/config, mig/monitor
    minors_lines = ["config 1", "monitor 2"]
    for g in gpus:
        for gi in range(_GI_PER_GPU):
            gi_minor, _ = mig_cap_minors(g.minor, gi, 0)
            minors_lines.append(f"gpu{g.minor}/gi{gi}/access {gi_minor}")
            for ci in range(_CI_PER_GI):
                minors_lines.append(f"gpu{g.minor}/gi{gi}/ci{ci}/access {mig_cap_minors(g.minor, gi, ci)[1]}")
        for gi, ci in g.mig:
            a, b = mig_cap_minors(g.minor, gi, ci)
            want_caps |= {f"nvidia-cap{a}", f"nvidia-cap{b}"}
    for name in want_caps:
        (caps / name).touch(exist_ok=True)
    for p in caps.glob("nvidia-cap*"):
        if p.name not in want_caps:
            p.unlink()
    _write(
        root / "proc" / "devices",
        "Character devices:\n  1 mem\n  4 /dev/vc/0\n"
        f"{FRONTEND_MAJOR} nvidia-frontend\n{CAPS_MAJOR} nvidia-caps\n{UVM_MAJOR} nvidia-uvm\n\n"
        "Block devices:\n  8 sd\n",
    )
    _write(root / "proc" / "driver" / "nvidia-caps" / "mig-minors", "\n".join(minors_lines) + "\n")
    bus_dir = root / "sys" / "bus" / "pci" / "devices"
    bus_dir.mkdir(parents=True, exist_ok=True)
    simpci.ensure_tree(root)
    for g in gpus:
        real = root / "sys" / "devices" / g.pcie_root / g.bus_id
        real.mkdir(parents=True, exist_ok=True)
        _write(real / "numa_node", f"{g.numa_node}\n")
        simpci.ensure_device(root, real, g.bus_id, simpci.IOMMU_GROUP_BASE + g.minor)
        link = bus_dir / g.bus_id
        target = os.path.relpath(real, bus_dir)
        if link.is_symlink() and os.readlink(link) == target:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
