"""The preparer's gRPC liveness service (`grpc.health.v1.Health`) on `--healthcheck-port`, as NVIDIA's plugin.

Owns what SERVING means: for every driver this process serves, a real `GetInfo` over its
registration socket that names the driver, and a real empty `NodePrepareResources` over its DRA
socket, both within `call_timeout`, while the event loop ticks (shared.health). Each check dials
the sockets afresh, so a socket that was removed or replaced by another process counts. Services
`""` and `"liveness"` are known (as upstream); any other is NOT_FOUND for Check and SERVICE_UNKNOWN
for Watch. The kubelet probes it with a `grpc:` probe on the TCP port.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from services.preparer.protos import dra_v1_pb2, dra_v1_pb2_grpc
from services.preparer.protos import grpc_health_v1_pb2 as pb2
from services.preparer.protos import grpc_health_v1_pb2_grpc as pb2_grpc
from services.preparer.protos import pluginregistration_v1_pb2 as reg_pb2
from services.preparer.protos import pluginregistration_v1_pb2_grpc as reg_grpc
from shared.health import HEALTH, Health
from shared.logs import get_logger

log = get_logger(__name__)

SERVICES = ("", "liveness")
SERVING = pb2.HealthCheckResponse.SERVING
NOT_SERVING = pb2.HealthCheckResponse.NOT_SERVING


class Plugin(Protocol):
    """What the check needs of one running kubelet plugin (a PreparerService)."""

    driver: str
    registration_socket: Path
    dra_socket: Path


class HealthCheck(pb2_grpc.HealthServicer):
    def __init__(
        self,
        plugins: Sequence[Plugin],
        *,
        health: Health = HEALTH,
        call_timeout: float = 2.0,
        watch_interval: float = 5.0,
    ) -> None:
        self.plugins = list(plugins)
        self.health = health
        self.call_timeout = call_timeout
        self.watch_interval = watch_interval
        self._last_problem: str | None = ""

    async def problem(self) -> str | None:
        """Why the preparer is not serving, or None when every plugin answers on both sockets."""
        stall = self.health.stalled()
        if stall is not None:
            return stall
        found = await asyncio.gather(*(self._plugin_problem(plugin) for plugin in self.plugins))
        return "; ".join(f for f in found if f is not None) or None

    async def _plugin_problem(self, plugin: Plugin) -> str | None:
        try:
            async with grpc.aio.insecure_channel(f"unix:{plugin.registration_socket}") as channel:
                info = await reg_grpc.RegistrationStub(channel).GetInfo(
                    reg_pb2.InfoRequest(), timeout=self.call_timeout
                )
        except grpc.aio.AioRpcError as exc:
            return f"{plugin.driver}: GetInfo on {plugin.registration_socket} failed: {exc.code().name} {exc.details()}"
        if info.name != plugin.driver:
            return f"{plugin.driver}: {plugin.registration_socket} answers for {info.name!r}"
        try:
            async with grpc.aio.insecure_channel(f"unix:{plugin.dra_socket}") as channel:
                await dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(
                    dra_v1_pb2.NodePrepareResourcesRequest(), timeout=self.call_timeout
                )
        except grpc.aio.AioRpcError as exc:
            return (
                f"{plugin.driver}: NodePrepareResources on {plugin.dra_socket} failed: "
                f"{exc.code().name} {exc.details()}"
            )
        return None

    async def _status(self) -> pb2.HealthCheckResponse.ServingStatus.ValueType:
        found = await self.problem()
        if found != self._last_problem:
            if found is None:
                log.info("gRPC health: serving", drivers=[p.driver for p in self.plugins])
            else:
                log.warning("gRPC health: not serving", reason=found)
            self._last_problem = found
        return SERVING if found is None else NOT_SERVING

    async def Check(self, request: Any, context: Any) -> pb2.HealthCheckResponse:  # noqa: N802
        if request.service not in SERVICES:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown service {request.service!r}; this server knows {', '.join(repr(s) for s in SERVICES)}",
            )
        return pb2.HealthCheckResponse(status=await self._status())

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[pb2.HealthCheckResponse]:  # noqa: N802
        """The status now, then again whenever it changes (re-checked every `watch_interval`)."""
        if request.service not in SERVICES:
            yield pb2.HealthCheckResponse(status=pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            await asyncio.Event().wait()  # per the protocol, the stream stays open
        last: pb2.HealthCheckResponse.ServingStatus.ValueType | None = None
        while True:
            status = await self._status()
            if status != last:
                yield pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(self.watch_interval)


class HealthCheckServer:
    """The health service on its own TCP port (all interfaces; the kubelet dials the pod IP)."""

    def __init__(self, check: HealthCheck, port: int, host: str = "[::]") -> None:
        self.check = check
        self.requested = f"{host}:{port}"
        self.port = 0
        self._server = grpc.aio.server()
        pb2_grpc.add_HealthServicer_to_server(check, self._server)

    async def start(self) -> None:
        try:
            self.port = self._server.add_insecure_port(self.requested)
        except RuntimeError as exc:
            raise OSError(
                f"cannot serve gRPC health on {self.requested}: {exc}; choose another --healthcheck-port"
            ) from exc
        await self._server.start()
        log.info("gRPC health service up", port=self.port, services=list(SERVICES))

    async def stop(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._server.stop(grace=0.5)
