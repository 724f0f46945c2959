"""The kubelet's side of the plugin protocols, for the local cluster and tests.

Owns what a real kubelet (1.34+) does with a DRA plugin: dial the registration socket, GetInfo
with a 1 s deadline, check the type, pick the first service version the plugin lists that the
kubelet knows (`v1.DRAPlugin`, `v1beta1.DRAPlugin`), report the registration status, then call
NodePrepareResources / NodeUnprepareResources on the advertised endpoint with a 45 s deadline (upstream's
`defaultClientCallTimeout` in pkg/kubelet/cm/dra/plugin, "half of the kubelet retry period"), a client span
and W3C trace context in gRPC metadata, and the kubelet's checks on the response. A call whose plugin is
dropped under it (its socket went away or registered again: the channel is closed) fails like any other
broken call, as in upstream's Go client (codes.Canceled), so the pod is tried again; Python's gRPC would
otherwise raise CancelledError into a caller nobody cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from embedded.kubelet import metrics
from services.preparer.protos import dra_health_v1alpha1_pb2 as health_pb2
from services.preparer.protos import dra_health_v1alpha1_pb2_grpc as health_grpc
from services.preparer.protos import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from services.preparer.protos import pluginregistration_v1_pb2 as reg_pb2
from services.preparer.protos import pluginregistration_v1_pb2_grpc as reg_grpc
from shared.tasks import cancelling
from shared.telemetry import get_tracer, inject_grpc_metadata

tracer = get_tracer(__name__)

GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
CALL_TIMEOUT = 45.0
KUBELET_SERVICES = {"v1.DRAPlugin": "v1", "v1beta1.DRAPlugin": "v1beta1"}
_HEALTH = {health_pb2.HEALTHY: "Healthy", health_pb2.UNHEALTHY: "Unhealthy"}  # anything else: Unknown
_MODULES = {"v1": (dra_v1_pb2, dra_v1_pb2_grpc), "v1beta1": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc)}


class PluginError(RuntimeError):
    """The plugin failed registration or answered a call in a way the kubelet rejects."""


@dataclass(frozen=True)
class Claim:
    namespace: str
    uid: str
    name: str


@dataclass
class PreparedDevice:
    request_names: list[str]
    pool: str
    device: str
    cdi_device_ids: list[str]
    share_id: str | None = None


@dataclass(frozen=True)
class DeviceHealthReport:
    """One device of a `NodeWatchResources` message (v1alpha1.DRAResourceHealth)."""

    pool: str
    device: str
    health: str  # Healthy, Unhealthy or Unknown, as the kubelet maps the enum
    last_updated: int  # unix seconds
    timeout_s: int = 0  # the plugin's health_check_timeout_seconds (0: the kubelet's default)


@dataclass
class PreparedClaim:
    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


def choose_version(supported: list[str], known: dict[str, str] = KUBELET_SERVICES) -> str:
    """The kubelet's rule: the first entry of the plugin's list that the kubelet knows."""
    if not supported:
        raise PluginError("the plugin lists no supported versions")
    for entry in supported:
        if entry in known:
            return known[entry]
    raise PluginError(
        f"none of services supported by the plugin ({supported}) are supported by the kubelet ({list(known)})"
    )


class DraPlugin:
    """A registered plugin's DRA service, as the kubelet calls it."""

    def __init__(self, driver: str, endpoint: str, version: str) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.version = version
        self._pb2, grpc_mod = _MODULES[version]
        self.channel = grpc.aio.insecure_channel(f"unix:{endpoint}")
        self._stub = grpc_mod.DRAPluginStub(self.channel)

    async def _call(self, method: str, claims: list[Claim], timeout: float) -> Any:
        request_type = getattr(self._pb2, f"{method}Request")
        request = request_type(claims=[self._pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims])
        with tracer.start_as_current_span(f"kubelet {method}", kind=SpanKind.CLIENT) as span:
            span.set_attribute("rpc.system", "grpc")
            span.set_attribute("rpc.service", f"k8s.io.kubelet.pkg.apis.dra.{self.version}.DRAPlugin")
            span.set_attribute("rpc.method", method)
            span.set_attribute("dra.driver", self.driver)
            full_method = f"/k8s.io.kubelet.pkg.apis.dra.{self.version}.DRAPlugin/{method}"
            with metrics.grpc_call(self.driver, full_method) as said:
                try:
                    response = await getattr(self._stub, method)(
                        request, timeout=timeout, metadata=inject_grpc_metadata()
                    )
                except grpc.aio.AioRpcError as exc:
                    said(exc.code())
                    span.set_status(Status(StatusCode.ERROR, exc.details() or str(exc.code())))
                    raise PluginError(
                        f"{method} on {self.endpoint} failed: {exc.code().name}: {exc.details()}"
                    ) from exc
                except asyncio.CancelledError:
                    said(grpc.StatusCode.CANCELLED)
                    if cancelling():
                        raise  # our caller is being cancelled
                    span.set_status(Status(StatusCode.ERROR, "channel closed"))
                    raise PluginError(
                        f"{method} on {self.endpoint} failed: CANCELLED: the channel closed during "
                        f"the call (the plugin's registration went away or was replaced)"
                    ) from None
            wanted = {c.uid for c in claims}
            unknown = [uid for uid in response.claims if uid not in wanted]
            if unknown:
                raise PluginError(f"{method} returned result for unknown claim UID(s) {unknown}")
            missing = wanted - set(response.claims)
            if missing:
                raise PluginError(f"{method} left out {len(missing)} claims")
            return response

    async def prepare(self, claims: list[Claim], timeout: float = CALL_TIMEOUT) -> dict[str, PreparedClaim]:
        response = await self._call("NodePrepareResources", claims, timeout)
        out: dict[str, PreparedClaim] = {}
        for uid, entry in response.claims.items():
            devices = [
                PreparedDevice(
                    list(d.request_names),
                    d.pool_name,
                    d.device_name,
                    list(d.cdi_device_ids),
                    d.share_id if self.version == "v1" and d.HasField("share_id") else None,
                )
                for d in entry.devices
            ]
            out[uid] = PreparedClaim(devices=devices if not entry.error else [], error=entry.error)
        return out

    async def unprepare(self, claims: list[Claim], timeout: float = CALL_TIMEOUT) -> dict[str, str]:
        response = await self._call("NodeUnprepareResources", claims, timeout)
        return {uid: entry.error for uid, entry in response.claims.items()}

    async def watch_health(self) -> AsyncIterator[list[DeviceHealthReport]]:
        """The plugin's `NodeWatchResources` stream (KEP-4680), one list per message; ends when the stream does.
        Raises grpc.aio.AioRpcError (UNIMPLEMENTED: the plugin serves no health stream)."""
        stub = health_grpc.DRAResourceHealthStub(self.channel)
        async for message in stub.NodeWatchResources(health_pb2.NodeWatchResourcesRequest()):
            yield [
                DeviceHealthReport(
                    d.device.pool_name,
                    d.device.device_name,
                    _HEALTH.get(d.health, "Unknown"),
                    d.last_updated_time,
                    d.health_check_timeout_seconds,
                )
                for d in message.devices
            ]

    async def close(self) -> None:
        """Close the channel; calls in flight on it fail with PluginError."""
        await self.channel.close()


def cdi_ids_for(prepared: PreparedClaim, request: str = "") -> list[str]:
    """The CDI IDs the kubelet gives a container referencing the claim (and optionally one request)."""
    ids: list[str] = []
    for dev in prepared.devices:
        if not request or not dev.request_names or request in dev.request_names:
            ids += dev.cdi_device_ids
    return ids


async def register(registration_socket: Path | str, *, known: dict[str, str] = KUBELET_SERVICES) -> DraPlugin:
    """Register the plugin behind `registration_socket` as the kubelet does, and connect to its endpoint."""
    path = Path(registration_socket)
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        try:
            info = await stub.GetInfo(reg_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            raise PluginError(f"GetInfo on {path} failed: {exc.code().name}: {exc.details()}") from exc
        try:
            if info.type != "DRAPlugin":
                raise PluginError(f"no handler registered for plugin type: {info.type}")
            version = choose_version(list(info.supported_versions), known)
        except PluginError as exc:
            try:
                await stub.NotifyRegistrationStatus(
                    reg_pb2.RegistrationStatus(plugin_registered=False, error=str(exc)), timeout=NOTIFY_TIMEOUT
                )
            except grpc.aio.AioRpcError:
                pass  # the plugin answers a refusal with an error of its own
            raise
        endpoint = info.endpoint or str(path)
        await stub.NotifyRegistrationStatus(
            reg_pb2.RegistrationStatus(plugin_registered=True, error=""), timeout=NOTIFY_TIMEOUT
        )
    return DraPlugin(info.name, endpoint, version)
