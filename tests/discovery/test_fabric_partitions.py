"""Fabric Manager NVLink partitions in discovery: listed through the fake driver root's `fmpm` (which records
every call and keeps the table in a file), put in the inventory matched to the node's GPUs, and activated
or deactivated on request over a real nats-server; the simulated Fabric Manager of a node without one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embedded.harness.discovery import running_discovery
from shared.bus import Bus
from shared.events import catalog
from shared.events.devices import PartitionActivateRequest, PartitionDeactivateRequest
from shared.events.inventory import NodeInventory
from tests.fabricmanager import HGX8, fake_fabric_manager


def table(inv: NodeInventory) -> dict[int, tuple[list[str], bool]]:
    assert inv.fabric_manager is not None
    return {p.id: (sorted(p.devices), p.active) for p in inv.fabric_manager.partitions}


async def activate(bus: Bus, partition: int, devices: list[str]) -> Any:
    return await bus.request(
        catalog.DEVICE_PARTITION_ACTIVATE,
        PartitionActivateRequest(partition_id=partition, devices=devices),
        timeout=20,
        node="n1",
    )


async def deactivate(bus: Bus, partition: int) -> Any:
    return await bus.request(
        catalog.DEVICE_PARTITION_DEACTIVATE, PartitionDeactivateRequest(partition_id=partition), timeout=20, node="n1"
    )


async def test_partitions_of_the_fake_fabric_manager_are_in_the_inventory(bus: Bus, tmp_path: Path) -> None:
    fake = await fake_fabric_manager(tmp_path, active=(4,))
    async with running_discovery(
        bus,
        node="n1",
        simulate="h100x8",
        root=tmp_path / "sim",
        driver_root=str(fake.root),
        fabric_manager_partitions=True,
    ) as disc:
        inv = disc.inventory
        assert [g.module_id for g in inv.gpus] == list(range(1, 9))
        parts = table(inv)
        assert len(parts) == 15
        assert parts[0] == ([f"gpu-{i}" for i in range(8)], False)
        assert parts[3] == (["gpu-0", "gpu-1"], False) and parts[4] == (["gpu-2", "gpu-3"], True)
        assert parts[14] == (["gpu-7"], False)
        assert inv.fabric_manager is not None and inv.fabric_manager.error == ""
        first = inv.fabric_manager.partitions[0].gpus[0]
        assert (first.module_id, first.pci_bus_id, first.uuid) == (1, inv.gpus[0].pci_bus_id, inv.gpus[0].uuid)
        assert first.nvlinks_available == 18
        socket = str(fake.root / "run" / "nvidia-fabricmanager" / "socket")
        assert fake.calls("fmpm")[0]["argv"] == ["-l", "--unix-domain-socket", socket]


async def test_activate_and_deactivate_on_request_are_idempotent(bus: Bus, tmp_path: Path) -> None:
    fake = await fake_fabric_manager(tmp_path)
    async with running_discovery(
        bus,
        node="n1",
        simulate="h100x8",
        root=tmp_path / "sim",
        driver_root=str(fake.root),
        fabric_manager_partitions=True,
    ) as disc:
        reply = await activate(bus, 3, ["gpu-1", "gpu-0"])
        assert reply.ok and reply.activated, reply.error
        assert fake.active_partitions() == [3] and table(disc.inventory)[3][1] is True  # rescanned before the reply
        again = await activate(bus, 3, ["gpu-0", "gpu-1"])
        assert again.ok and not again.activated
        overlapping = await activate(bus, 0, [f"gpu-{i}" for i in range(8)])
        assert not overlapping.ok and overlapping.error is not None
        assert overlapping.error.code == "fabric-manager-error" and "fmReturn: -14" in overlapping.error.message
        wrong = await activate(bus, 5, ["gpu-0", "gpu-1"])
        assert not wrong.ok and wrong.error is not None and wrong.error.code == "invalid-argument"
        assert "gpu-4" in wrong.error.message
        unknown = await activate(bus, 99, ["gpu-0"])
        assert not unknown.ok and unknown.error is not None and unknown.error.code == "not-found"
        changes = [c["argv"][:2] for c in fake.calls("fmpm") if c["argv"][0] != "-l"]
        assert changes == [["-a", "3"], ["-a", "0"]], "no call for a repeat, a mismatch or an unknown id"

        off = await deactivate(bus, 3)
        assert off.ok and off.deactivated
        assert (await deactivate(bus, 3)).deactivated is False
        assert fake.active_partitions() == [] and table(disc.inventory)[3][1] is False
        assert [c["argv"][:2] for c in fake.calls("fmpm") if c["argv"][0] == "-d"] == [["-d", "3"]]


async def test_a_fabric_manager_that_fails_is_reported_not_fatal(bus: Bus, tmp_path: Path) -> None:
    fake = await fake_fabric_manager(tmp_path)
    fake.fail("fmpm", "Failed to get partition list. fmReturn: -3")
    async with running_discovery(
        bus,
        node="n1",
        simulate="h100x8",
        root=tmp_path / "sim",
        driver_root=str(fake.root),
        fabric_manager_partitions=True,
    ) as disc:
        fm = disc.inventory.fabric_manager
        assert fm is not None and fm.partitions == [] and "fmReturn: -3" in fm.error
        assert len(disc.inventory.gpus) == 8
        fake.heal("fmpm")
        assert len(table(await disc.rescan())) == len(HGX8)


async def test_without_the_flag_there_are_no_partitions(bus: Bus, tmp_path: Path) -> None:
    fake = await fake_fabric_manager(tmp_path)
    async with running_discovery(
        bus, node="n1", simulate="h100x8", root=tmp_path / "sim", driver_root=str(fake.root)
    ) as disc:
        assert disc.inventory.fabric_manager is None
        reply = await activate(bus, 3, ["gpu-0", "gpu-1"])
        assert not reply.ok and reply.error is not None and reply.error.code == "not-supported"
        assert fake.calls("fmpm") == []


async def test_the_simulated_fabric_manager_keeps_its_partitions_across_restarts(bus: Bus, tmp_path: Path) -> None:
    async with running_discovery(
        bus, node="n1", simulate="h100x8", root=tmp_path / "sim", fabric_manager_partitions=True
    ) as disc:
        parts = table(disc.inventory)
        assert {pid: devices for pid, (devices, _) in parts.items()} == {
            pid: [f"gpu-{m - 1}" for m in modules] for pid, modules in HGX8
        }
        assert (await activate(bus, 1, ["gpu-0", "gpu-1", "gpu-2", "gpu-3"])).activated
        refused = await activate(bus, 3, ["gpu-0", "gpu-1"])
        assert not refused.ok and refused.error is not None and "in use" in refused.error.message
    async with running_discovery(
        bus, node="n1", simulate="h100x8", root=tmp_path / "sim", fabric_manager_partitions=True
    ) as disc:
        assert [pid for pid, (_, active) in table(disc.inventory).items() if active] == [1]
