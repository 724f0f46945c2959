"""What one publisher replica knows of the fleet's nodes: every node's name and newest observation, the
inventories of the nodes it owns, device health, withdrawals.

Memory per node is bounded by ownership: an inventory (~38 kB decoded for 8 H100s, 139 objects the
collector walks) is kept only for a node this replica owns; of the others it keeps the name and the
newest `observed_at`, so that an older copy is still refused once the node is gained and its
inventory read back from KV (`services.publisher.service`). At 65,000 nodes on 4 replicas that is a
quarter of the inventories per replica instead of all of them (bench/fleet_bench.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.events.health import DeviceHealth
from shared.events.inventory import NodeInventory


class NodeState:
    """What the publisher knows of every node, newest observation first-class.

    Every accepted inventory, withdrawal and health report is numbered in the order this replica
    received it (`received`). A KV read drops what KV no longer holds only if it was received before
    the read began: an event that arrives while KV is being read may be newer than what the read
    returns, whatever its observation time says.
    """

    def __init__(self) -> None:
        self.inventory: dict[str, NodeInventory] = {}  # the nodes this replica owns
        self.observed: dict[str, float] = {}  # every node with an inventory: its newest observed_at
        self.health: dict[str, dict[str, DeviceHealth]] = {}
        self.withdrawn: dict[str, float] = {}
        self.received = 0
        self._inventory_seq: dict[str, int] = {}
        self._health_seq: dict[tuple[str, str], int] = {}

    def set_inventory(self, inv: NodeInventory, *, keep: bool = True) -> bool:
        """Accept `inv` unless an newer one (or a later withdrawal) is known; `keep`: hold the inventory
        itself (a node this replica owns), else only its name and observation time."""
        current = self.observed.get(inv.node)
        if current is not None and inv.observed_at < current:
            return False
        if inv.observed_at and inv.observed_at < self.withdrawn.get(inv.node, 0.0):
            return False
        self.withdrawn.pop(inv.node, None)
        self.observed[inv.node] = inv.observed_at
        if keep:
            self.inventory[inv.node] = inv
        else:
            self.inventory.pop(inv.node, None)
        self.received += 1
        self._inventory_seq[inv.node] = self.received
        return True

    def release(self, nodes: Iterable[str]) -> None:
        """Nodes another replica now owns: their inventories go; names and observation times stay."""
        for node in nodes:
            self.inventory.pop(node, None)

    def withdraw(self, node: str, at: float) -> None:
        self.inventory.pop(node, None)
        self.observed.pop(node, None)
        self.withdrawn[node] = at
        self.received += 1
        self._inventory_seq[node] = self.received

    def set_health(self, h: DeviceHealth) -> bool:
        devices = self.health.setdefault(h.node, {})
        current = devices.get(h.device)
        if current is not None and h.observed_at < current.observed_at:
            return False
        devices[h.device] = h
        self.received += 1
        self._health_seq[(h.node, h.device)] = self.received
        return True

    def drop_absent(self, health: set[tuple[str, str]], read_began: int) -> None:
        """After a KV read that began when `received` was `read_began`: forget the device health KV no
        longer holds and nothing since renewed. Inventories are never dropped this way: a key that reads
        back missing or undecodable (a KV error, a garbage value, a NATS outage) says nothing about the
        node's GPUs, so its last inventory stands until an explicit withdrawal or the Node's removal."""
        for node, devices in self.health.items():
            for device in list(devices):
                if (node, device) not in health and self._health_seq.get((node, device), 0) <= read_began:
                    devices.pop(device, None)

    def nodes(self) -> set[str]:
        return set(self.observed) | set(self.withdrawn)
