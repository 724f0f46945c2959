"""The kubelet plugin-registration service (`pluginregistration.Registration`) on `<registry>/<driver>-reg.sock`.

Owns what the kubelet learns from GetInfo (type DRAPlugin, driver name, DRA endpoint, the service
versions we serve, newest first) and the registration status it reports back.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from services.preparer.protos import pluginregistration_v1_pb2 as reg_pb2
from services.preparer.protos import pluginregistration_v1_pb2_grpc as reg_grpc
from shared.logs import get_logger

log = get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


class Registration(reg_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: str, versions: tuple[str, ...] = SUPPORTED_VERSIONS) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.versions = versions
        self.registered = asyncio.Event()
        self.last_error = ""

    async def GetInfo(self, request: Any, context: Any) -> reg_pb2.PluginInfo:  # noqa: N802
        return reg_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=self.driver, endpoint=self.endpoint, supported_versions=list(self.versions)
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> reg_pb2.RegistrationStatusResponse:  # noqa: N802
        if request.plugin_registered:
            self.last_error = ""
            self.registered.set()
            log.info("registered with the kubelet", driver=self.driver, endpoint=self.endpoint)
        else:
            self.last_error = request.error
            self.registered.clear()
            log.error("the kubelet refused the registration", driver=self.driver, error=request.error)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"registration failed: {request.error}")
        return reg_pb2.RegistrationStatusResponse()


def add_registration_service(server: Any, registration: Registration) -> None:
    reg_grpc.add_RegistrationServicer_to_server(registration, server)
