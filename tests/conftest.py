"""Fixtures shared by every test: a real nats-server with JetStream, and a provisioned Bus on it.

The run's watchdog is the plugin tests/watchdog.py (`-p tests.watchdog` in pyproject's addopts)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shared.bus import Bus
from shared.natsserver import EmbeddedNats


@pytest.fixture
async def nats_server(tmp_path) -> AsyncIterator[EmbeddedNats]:
    srv = EmbeddedNats(store_dir=tmp_path / "nats")
    await srv.start()
    try:
        yield srv
    finally:
        await srv.close()


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    connected = await Bus.connect(nats_server.url, name="test-harness")
    await connected.provision()
    try:
        yield connected
    finally:
        await connected.close()
