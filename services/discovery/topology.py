"""PCI topology from sysfs: the NUMA node and PCIe root complex of a GPU by bus id.

Reads `<sys_root>/sys/bus/pci/devices/<bdf>` the same way on real and simulated nodes.
"""

from __future__ import annotations

import re
from pathlib import Path

_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}\Z")


def normalise_bus_id(bus_id: str) -> str:
    """NVML's `00000000:3B:00.0` → `0000:3b:00.0` (4-digit domain, lowercase)."""
    text = bus_id.strip().lower()
    domain, _, rest = text.partition(":")
    if not rest:
        return text
    return f"{int(domain, 16):04x}:{rest}"


def pci_topology(sys_root: Path, bus_id: str) -> tuple[str, int]:
    """(pcie root like `pci0000:3a` or "", numa node or -1) for a GPU; unknowns are empty/-1."""
    dev = Path(sys_root) / "sys" / "bus" / "pci" / "devices" / bus_id
    root = ""
    numa = -1
    try:
        for part in dev.resolve(strict=True).parts:
            if _ROOT.match(part):
                root = part
                break
    except OSError:
        return "", -1
    try:
        numa = int((dev / "numa_node").read_text().strip())
    except (OSError, ValueError):
        numa = -1
    return root, numa
