"""The kubelet's DRA client: a call whose plugin is dropped under it (channel closed) fails like a broken call,
and a caller that is itself cancelled still gets its CancelledError."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from embedded.kubelet.client import Claim, DraPlugin, PluginError
from services.preparer.protos import dra_v1_pb2, dra_v1_pb2_grpc
from tests.preparer.helpers import cleanup, short_root

CLAIM = Claim(namespace="default", uid="u1", name="c")


class Held(dra_v1_pb2_grpc.DRAPluginServicer):
    """Answers no prepare: every call stays in flight until the client gives up."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()

    async def NodePrepareResources(self, request: object, context: object) -> dra_v1_pb2.NodePrepareResourcesResponse:
        self.arrived.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def NodeUnprepareResources(
        self, request: object, context: object
    ) -> dra_v1_pb2.NodeUnprepareResourcesResponse:
        return dra_v1_pb2.NodeUnprepareResourcesResponse()


@pytest.fixture
async def held() -> AsyncIterator[tuple[Held, Path]]:
    root = short_root()
    servicer = Held()
    server = grpc.aio.server()
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(servicer, server)
    socket = root / "dra.sock"
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    try:
        yield servicer, socket
    finally:
        await server.stop(0)
        cleanup(root)


async def test_a_call_in_flight_when_the_plugin_is_closed_fails_with_plugin_error(held: tuple[Held, Path]) -> None:
    servicer, socket = held
    plugin = DraPlugin("gpu.nvidia.com", str(socket), "v1")
    call = asyncio.create_task(plugin.prepare([CLAIM]))
    await servicer.arrived.wait()
    await plugin.close()  # what the registry does when the socket goes away or registers again
    with pytest.raises(PluginError, match="CANCELLED: the channel closed during the call"):
        await asyncio.wait_for(call, 5)


async def test_a_cancelled_caller_still_gets_cancelled(held: tuple[Held, Path]) -> None:
    servicer, socket = held
    plugin = DraPlugin("gpu.nvidia.com", str(socket), "v1")
    try:
        call = asyncio.create_task(plugin.prepare([CLAIM]))
        await servicer.arrived.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        with contextlib.suppress(Exception):
            await plugin.close()
