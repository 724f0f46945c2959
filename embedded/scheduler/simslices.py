"""ResourceSlices of simulated nodes without NATS or an API server, for tests and benchmarks.

Owns one path: a `--simulate` spec or machine file -> the simulated NVML -> discovery's inventory
-> the publisher's pool layout and slice objects, the same code the running services use, so the
devices here are the devices a local cluster publishes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Literal

from embedded.harness.discovery import scan_simulated
from services.publisher import objects, slices
from services.publisher.apiversion import ServerProfile, layout_for
from shared.events.health import DeviceHealth
from shared.events.inventory import NodeInventory


async def simulated_inventory(
    node: str, simulate: str = "h100x8", machine: str = "", root: Path | str | None = None
) -> NodeInventory:
    """Scan a simulated machine once (its fake /dev tree lives under `root`, a temp dir by default)."""
    base = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="gpu-dra-sched-"))
    return await scan_simulated(base, node, simulate, machine)


def node_slices(
    inv: NodeInventory,
    *,
    mig_mode: Literal["static", "dynamic"] = "static",
    minor: int = 34,
    health: dict[str, DeviceHealth] | None = None,
    generation: int = 1,
    compute_domains: bool = False,
) -> list[dict[str, Any]]:
    """The node's slices (v1 objects) as the publisher would write them to a 1.`minor` server."""
    profile = ServerProfile(minor=minor, counter_layout=layout_for(1, minor))
    opts = slices.SliceOptions(mig_mode=mig_mode, compute_domains=compute_domains)
    out: list[dict[str, Any]] = []
    for pool in slices.desired_pools(inv, health or {}, opts, profile).values():
        for rendered in objects.render(pool, node_uid=f"uid-{inv.node}"):
            out.append(rendered.body(generation, profile))
    return out


def renamed(slices_of_node: list[dict[str, Any]], old: str, new: str) -> list[dict[str, Any]]:
    """The same slices for another node name (device UUIDs keep their value; fine for load tests)."""
    text = json.dumps(slices_of_node).replace(f'"{old}"', f'"{new}"').replace(f'"{old}-', f'"{new}-')
    result: list[dict[str, Any]] = json.loads(text)
    return result
