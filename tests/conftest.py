"""Fixtures shared by every test: a real nats-server with JetStream, a provisioned Bus on it, and a
module's finished spans.

The run's watchdog is the plugin tests/watchdog.py (`-p tests.watchdog` in pyproject's addopts)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.bus import Bus
from shared.natsserver import EmbeddedNats
from shared.telemetry import setup_telemetry


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


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """Finished spans of this module's tests, whatever tracer provider the process installed first."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        installed = setup_telemetry("gpu-dra-tests", "memory")
        assert installed is not None
        provider = installed
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter
