"""Node inventories for publisher tests, made by the real discovery scanner over simulated NVML."""

from __future__ import annotations

from pathlib import Path

import msgspec
import yaml

from embedded.harness.discovery import scan_simulated
from shared.events.inventory import Gpu, NodeInventory


async def scan(tmp_path: Path, node: str, *, simulate: str = "", machine: dict | None = None) -> NodeInventory:
    """The inventory `gpu-dra discovery --once` would print for this simulated machine."""
    machine_file = ""
    if machine is not None:
        path = tmp_path / f"{node}-machine.yaml"
        path.write_text(yaml.safe_dump(machine))
        machine_file = str(path)
    return await scan_simulated(tmp_path / "dev", node, simulate, machine_file)


STATIC_MIG_MACHINE = {
    "gpus": [
        {
            "profile": "a100-40gb",
            "count": 1,
            "mig_enabled": True,
            "mig_devices": [
                {"profile": "1g.5gb", "placement": 0},
                {"profile": "1g.5gb", "placement": 1},
                {"profile": "2g.10gb", "placement": 2},
                {"profile": "3g.20gb", "placement": 4},
            ],
        },
        {"profile": "a100-40gb", "count": 1},
    ]
}


def widened(inv: NodeInventory, gpu_count: int, node: str | None = None) -> NodeInventory:
    """The inventory with its first GPU repeated `gpu_count` times (minors 0..n-1): a synthetic big node."""
    first = inv.gpus[0]
    gpus: list[Gpu] = [
        msgspec.structs.replace(
            first,
            name=f"gpu-{i}",
            index=i,
            minor=i,
            uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000",
            mig_devices=[],
            mig_enabled=False,
        )
        for i in range(gpu_count)
    ]
    return msgspec.structs.replace(inv, node=node or inv.node, gpus=gpus)
