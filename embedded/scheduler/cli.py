"""`gpu-dra scheduler`: the local cluster's DRA scheduler — flags -> config -> Scheduler.run()."""

from __future__ import annotations

import asyncio
import sys

from kubernetes_asyncio import client
from kubernetes_asyncio import config as kube_config

from embedded.scheduler.loop import Scheduler
from shared.config import CommonConfig, ConfigError, load_config
from shared.runtime import prepare_process, run_until_stopped

DESCRIPTION = ("DRA scheduler of the local cluster: generates claims from templates and extended resources, "
               "allocates devices from ResourceSlices, reserves claims and binds pods; frees claims of finished pods.")


class SchedulerConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    kubeconfig: str = ""
    resync_seconds: float = 30.0


async def run(cfg: SchedulerConfig, stopping: asyncio.Event) -> None:
    api_cfg = client.Configuration()
    await kube_config.load_kube_config(config_file=cfg.kubeconfig or None, client_configuration=api_cfg)
    async with client.ApiClient(api_cfg) as api:
        await Scheduler(api, resync_seconds=cfg.resync_seconds).run(stopping)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(SchedulerConfig, list(sys.argv[1:] if argv is None else argv), prog="gpu-dra scheduler",
                          description=DESCRIPTION)
    except ConfigError as exc:
        print(f"gpu-dra scheduler: {exc}", file=sys.stderr)
        return 2
    prepare_process(cfg, "scheduler")
    asyncio.run(run_until_stopped(lambda stopping: run(cfg, stopping)))
    return 0
