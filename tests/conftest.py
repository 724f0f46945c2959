"""Fixtures shared by every test: a real nats-server with JetStream."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shared.natsserver import EmbeddedNats


@pytest.fixture
async def nats_server(tmp_path) -> AsyncIterator[EmbeddedNats]:
    srv = EmbeddedNats(store_dir=tmp_path / "nats")
    await srv.start()
    try:
        yield srv
    finally:
        await srv.close()
