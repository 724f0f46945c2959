"""`gpu-dra controllers`: the local cluster's workload controllers — flags -> config -> Controllers.run()."""

from __future__ import annotations

import asyncio
from typing import Annotated

import msgspec

from embedded.controllers.runner import Controllers
from shared.config import CommonConfig
from shared.kube.client import kube_api_client
from shared.runtime import service_main

DESCRIPTION = (
    "Workload controllers of the local cluster: Deployments -> ReplicaSets -> Pods and Jobs -> Pods, "
    "driven by watches on the API server, until SIGTERM/SIGINT."
)


class ControllersConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    kubeconfig: Annotated[str, msgspec.Meta(description="kubeconfig of the API server; empty: the default")] = ""
    resync_seconds: Annotated[float, msgspec.Meta(gt=0, description="seconds between full resyncs (backstop)")] = 30.0


async def run(cfg: ControllersConfig, stopping: asyncio.Event) -> None:
    async with await kube_api_client(cfg.kubeconfig) as api:
        await Controllers(api, resync_seconds=cfg.resync_seconds).run(stopping)


def main(argv: list[str] | None = None) -> int:
    return service_main(
        ControllersConfig,
        argv,
        prog="gpu-dra controllers",
        description=DESCRIPTION,
        service=lambda cfg: "controllers",
        run=run,
    )
