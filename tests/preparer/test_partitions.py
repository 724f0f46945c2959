"""NVLink partitions on prepare and unprepare: the preparer over its real socket, discovery in-process on a
simulated HGX H100 board whose Fabric Manager is the fake driver root's `fmpm` (it records its calls and
keeps the partition table in a file), over a real nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from embedded.harness.discovery import RunningDiscovery, running_discovery
from shared.bus import Bus
from tests.fabricmanager import fake_fabric_manager
from tests.fakedriver import FakeDriver
from tests.preparer.helpers import MemoryClaims, claim_doc, gpu_config, running_node


@pytest.fixture
async def fm(root: Path) -> FakeDriver:
    return await fake_fabric_manager(root)


@pytest.fixture
async def fm_discovery(bus: Bus, root: Path, fm: FakeDriver) -> AsyncIterator[RunningDiscovery]:
    async with running_discovery(
        bus,
        node="n1",
        simulate="h100x8",
        root=root / "sim",
        driver_root=str(fm.root),
        tool_timeout=5.0,
        fabric_manager_partitions=True,
    ) as disc:
        yield disc


def changes(fake: FakeDriver) -> list[list[str]]:
    """Every fmpm call that changes Fabric Manager's state, as [flag, id]."""
    return [c["argv"][:2] for c in fake.calls("fmpm") if c["argv"][0] in ("-a", "-d")]


TIME_SLICED = gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}})


async def test_a_claim_of_one_partition_activates_it_and_unprepare_deactivates_it(
    claims: MemoryClaims, root: Path, bus: Bus, fm: FakeDriver, fm_discovery: RunningDiscovery
) -> None:
    claim = claims.add(claim_doc(name="pair", results=[("gpus", "gpu-1"), ("gpus", "gpu-0")]))
    async with running_node(claims, root, bus=bus) as node:
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        assert fm.active_partitions() == [3] and changes(fm) == [["-a", "3"]]
        assert node.service.checkpoint.claims[claim.uid].fabric_partition == 3
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert fm.active_partitions() == [] and changes(fm) == [["-a", "3"], ["-d", "3"]]


async def test_a_partition_stays_active_until_its_last_claim_is_unprepared(
    claims: MemoryClaims, root: Path, bus: Bus, fm: FakeDriver, fm_discovery: RunningDiscovery
) -> None:
    first = claims.add(claim_doc(name="a", results=[("gpus", "gpu-2"), ("gpus", "gpu-3")], configs=[TIME_SLICED]))
    second = claims.add(claim_doc(name="b", results=[("gpus", "gpu-3"), ("gpus", "gpu-2")], configs=[TIME_SLICED]))
    async with running_node(claims, root, bus=bus) as node:
        assert (await node.plugin.prepare([first]))[first.uid].error == ""
        assert (await node.plugin.prepare([second]))[second.uid].error == ""
        assert fm.active_partitions() == [4] and changes(fm) == [["-a", "4"]], "the second finds it active"
        assert await node.plugin.unprepare([first]) == {first.uid: ""}
        assert fm.active_partitions() == [4] and changes(fm) == [["-a", "4"]], "kept for the second claim"
        assert await node.plugin.unprepare([second]) == {second.uid: ""}
        assert fm.active_partitions() == [] and changes(fm) == [["-a", "4"], ["-d", "4"]]


@pytest.mark.parametrize(
    "gpus", [["gpu-0", "gpu-2"], ["gpu-0", "gpu-1", "gpu-2"]], ids=["two-partitions", "part-of-one"]
)
async def test_gpus_that_form_no_partition_are_refused_with_nothing_changed(
    claims: MemoryClaims, root: Path, bus: Bus, fm: FakeDriver, fm_discovery: RunningDiscovery, gpus: list[str]
) -> None:
    claim = claims.add(claim_doc(name="span", results=[("gpus", g) for g in gpus]))
    async with running_node(claims, root, bus=bus) as node:
        error = (await node.plugin.prepare([claim]))[claim.uid].error
        assert "do not form one NVLink partition" in error and "gpu.nvidia.com/partition" in error, error
        assert "gpu-0 in partition 7 (1 GPU(s))" in error
        assert claim.uid not in node.service.checkpoint.claims
        assert not list((root / "cdi").glob(f"*{claim.uid}*"))
        assert changes(fm) == [] and fm.active_partitions() == []


async def test_a_single_gpu_gets_its_one_gpu_partition_and_mig_free_claims_elsewhere_are_untouched(
    claims: MemoryClaims, root: Path, bus: Bus, fm: FakeDriver, fm_discovery: RunningDiscovery
) -> None:
    one = claims.add(claim_doc(name="one", results=[("gpu", "gpu-7")]))
    board = claims.add(claim_doc(name="board", results=[("gpus", f"gpu-{i}") for i in range(4)]))
    async with running_node(claims, root, bus=bus) as node:
        prepared = await node.plugin.prepare([one, board])
        assert prepared[one.uid].error == "" and prepared[board.uid].error == ""
        assert sorted(fm.active_partitions()) == [1, 14]
        assert await node.plugin.unprepare([one, board]) == {one.uid: "", board.uid: ""}
        assert fm.active_partitions() == []


async def test_an_activation_fabric_manager_refuses_fails_the_prepare_and_leaves_nothing(
    claims: MemoryClaims, root: Path, bus: Bus, fm: FakeDriver, fm_discovery: RunningDiscovery
) -> None:
    claim = claims.add(claim_doc(name="refused", results=[("gpus", "gpu-4"), ("gpus", "gpu-5")]))
    fm.fail_once("fmpm", "Failed to activate partition. fmReturn: -5", when="-a")
    async with running_node(claims, root, bus=bus) as node:
        error = (await node.plugin.prepare([claim]))[claim.uid].error
        assert "activate NVLink partition 5" in error and "fmReturn: -5" in error, error
        assert claim.uid not in node.service.checkpoint.claims
        assert fm.active_partitions() == [] and changes(fm) == [["-a", "5"]], (
            f"never active: no deactivation; {fm.calls('fmpm')}"  # read only when it fails
        )
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        assert fm.active_partitions() == [5]
