"""Fixtures for the preparer tests: a short temp root, in-memory claims, a bus, a simulated discovery."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from embedded.harness.discovery import RunningDiscovery, running_discovery
from shared.bus import Bus
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
