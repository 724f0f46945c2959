"""Discovery fixtures: a Bus on the real nats-server and an in-process simulated node."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shared.bus import Bus
from shared.natsserver import EmbeddedNats


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_server.url, name="discovery-test")
    await b.provision()
    try:
        yield b
    finally:
        await b.close()
