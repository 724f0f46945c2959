"""Fixtures for the preparer tests: a short temp root, in-memory claims, a bus, a simulated discovery (and one
running the driver's stub binaries from a fake driver root, for sharing: MPS, time slices)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from embedded.harness.discovery import RunningDiscovery, running_discovery
from shared.bus import Bus
from tests.fakedriver import FakeDriver, make_driver_root
from tests.preparer.helpers import MemoryClaims, cleanup, short_root


@pytest.fixture
def root() -> Iterator[Path]:
    path = short_root()
    try:
        yield path
    finally:
        cleanup(path)


@pytest.fixture
def claims() -> MemoryClaims:
    return MemoryClaims()


@pytest.fixture
async def discovery(bus: Bus, root: Path) -> AsyncIterator[RunningDiscovery]:
    async with running_discovery(bus, node="n1", simulate="h100x8", root=root / "sim") as disc:
        yield disc


@pytest.fixture
def fake(root: Path) -> FakeDriver:
    return make_driver_root(root / "driver")


@pytest.fixture
async def real_discovery(bus: Bus, root: Path, fake: FakeDriver) -> AsyncIterator[RunningDiscovery]:
    """Discovery on four simulated H100s whose MPS and time-slice commands run the fake driver root's stubs."""
    async with running_discovery(
        bus, node="n1", simulate="h100x4", root=root / "sim", driver_root=str(fake.root), tool_timeout=5.0
    ) as disc:
        yield disc
