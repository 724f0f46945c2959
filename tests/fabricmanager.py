"""Fabric Manager fixtures: an HGX 8-GPU partition table for the fake driver root's `fmpm` (tests/fakedriver.py),
over the GPUs a simulated node has (so PCI bus ids and UUIDs match discovery's)."""

from __future__ import annotations

from pathlib import Path

from embedded.harness.discovery import scan_simulated
from tests.fakedriver import DRIVER_BINARIES, FakeDriver, make_driver_root

# NVIDIA's HGX 8-GPU table as its driver's docs describe it: the board, two halves, four pairs, eight singles.
HGX8 = [
    (0, list(range(1, 9))),
    (1, [1, 2, 3, 4]),
    (2, [5, 6, 7, 8]),
    (3, [1, 2]),
    (4, [3, 4]),
    (5, [5, 6]),
    (6, [7, 8]),
    *((7 + i, [i + 1]) for i in range(8)),
]


def nvml_bus_id(bus: str) -> str:
    """`0000:3b:00.0` -> `00000000:3B:00.0`, as Fabric Manager (and NVML) print it."""
    domain, rest = bus.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


async def fake_fabric_manager(
    base: Path, *, node: str = "n1", simulate: str = "h100x8", active: tuple[int, ...] = ()
) -> FakeDriver:
    """A fake driver root with `fmpm` whose table is HGX8 over `node`'s simulated GPUs."""
    fake = make_driver_root(base / "driver", binaries=(*DRIVER_BINARIES, "fmpm"))
    inv = await scan_simulated(base / "prescan", node, simulate)
    fake.set_partitions(HGX8, [(g.module_id, nvml_bus_id(g.pci_bus_id), g.uuid) for g in inv.gpus], active)
    return fake
