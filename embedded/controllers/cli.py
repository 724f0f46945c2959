"""`gpu-dra controllers`: the local cluster's workload controllers — flags -> config -> Controllers.run()."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated

import msgspec
from kubernetes_asyncio import client
from kubernetes_asyncio import config as kube_config

from embedded.controllers.runner import Controllers
from shared.config import CommonConfig, ConfigError, load_config
from shared.runtime import prepare_process, run_until_stopped

DESCRIPTION = ("Workload controllers of the local cluster: Deployments -> ReplicaSets -> Pods and Jobs -> Pods, "
               "driven by watches on the API server, until SIGTERM/SIGINT.")


class ControllersConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    kubeconfig: Annotated[str, msgspec.Meta(description="kubeconfig of the API server; empty: the default")] = ""
    resync_seconds: Annotated[float, msgspec.Meta(gt=0, description="seconds between full resyncs (backstop)")] = 30.0


async def run(cfg: ControllersConfig, stopping: asyncio.Event) -> None:
    api_cfg = client.Configuration()
    await kube_config.load_kube_config(config_file=cfg.kubeconfig or None, client_configuration=api_cfg)
    async with client.ApiClient(api_cfg) as api:
        await Controllers(api, resync_seconds=cfg.resync_seconds).run(stopping)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(ControllersConfig, list(sys.argv[1:] if argv is None else argv),
                          prog="gpu-dra controllers", description=DESCRIPTION)
    except ConfigError as exc:
        print(f"gpu-dra controllers: {exc}", file=sys.stderr)
        return 2
    prepare_process(cfg, "controllers")
    asyncio.run(run_until_stopped(lambda stopping: run(cfg, stopping)))
    return 0
