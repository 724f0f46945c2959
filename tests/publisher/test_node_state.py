"""The publisher's node state: a KV absence is never a withdrawal; an explicit one refuses older copies."""

from __future__ import annotations

from services.publisher.nodestate import NodeState
from shared.events.health import DeviceHealth
from shared.events.inventory import NodeInventory


def inventory(node: str, observed_at: float) -> NodeInventory:
    return NodeInventory(node=node, driver_version="550.163.1", cuda_driver_version="12.4.0", observed_at=observed_at)


def test_an_inventory_kv_no_longer_holds_is_kept() -> None:
    """A KV read that comes back without a node's key (an error, a garbage value skipped, an outage)
    is no withdrawal: the node's last inventory stands and its slices stay."""
    state = NodeState()
    state.set_inventory(inventory("early", 50.0))
    read_began = state.received
    assert state.set_inventory(inventory("late", 100.0))  # an event, mid-read
    state.drop_absent(set(), read_began)
    assert set(state.inventory) == {"early", "late"}
    assert state.withdrawn == {}


def test_an_explicit_withdrawal_still_refuses_the_older_inventory() -> None:
    state = NodeState()
    state.set_inventory(inventory("n1", 100.0))
    state.withdraw("n1", 120.0)
    assert not state.set_inventory(inventory("n1", 100.0))
    assert state.set_inventory(inventory("n1", 130.0))


def test_health_received_during_the_read_survives_and_older_health_goes() -> None:
    state = NodeState()
    state.set_health(DeviceHealth(node="n1", device="gpu-0", state="Unhealthy", observed_at=10.0))
    read_began = state.received
    state.set_health(DeviceHealth(node="n1", device="gpu-1", state="Unhealthy", observed_at=5.0))
    state.drop_absent(set(), read_began)
    assert set(state.health["n1"]) == {"gpu-1"}
