"""The publisher's node state: which KV absences count as withdrawals, and which later copies come back."""

from __future__ import annotations

from services.publisher.service import NodeState
from shared.events.health import DeviceHealth
from shared.events.inventory import NodeInventory


def inventory(node: str, observed_at: float) -> NodeInventory:
    return NodeInventory(node=node, driver_version="550.163.1", cuda_driver_version="12.4.0",
                         observed_at=observed_at)


def test_an_inventory_received_while_kv_is_read_survives_the_reads_absence() -> None:
    """Discovery scans at t=100, writes KV, then publishes; the publisher's KV read began at t=101 but
    listed the keys before the write landed, and the event arrived during the read. The node stays."""
    state = NodeState()
    state.set_inventory(inventory("early", 50.0))  # known before the read; KV no longer has it
    read_began = state.received
    assert state.set_inventory(inventory("late", 100.0))  # the event, mid-read
    state.drop_absent(set(), set(), read_began)
    assert set(state.inventory) == {"late"}
    assert state.withdrawn == {"early": 50.0}


def test_a_node_dropped_for_its_absence_comes_back_with_the_same_inventory() -> None:
    state = NodeState()
    state.set_inventory(inventory("n1", 100.0))
    state.drop_absent(set(), set(), state.received)
    assert "n1" not in state.inventory and "n1" in state.nodes()  # its slices are deleted
    assert state.set_inventory(inventory("n1", 100.0))  # a later KV read holds it after all
    assert "n1" in state.inventory and "n1" not in state.withdrawn


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
    state.drop_absent({"n1"}, set(), read_began)
    assert set(state.health["n1"]) == {"gpu-1"}
