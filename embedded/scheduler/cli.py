"""`gpu-dra scheduler`: the local cluster's DRA scheduler — flags -> config -> Scheduler.run()."""

from __future__ import annotations

import asyncio
from typing import Annotated

import msgspec

from embedded.scheduler.celworker import CPU_LIMIT_S
from embedded.scheduler.loop import Scheduler
from shared.config import CommonConfig
from shared.kube.client import kube_api_client
from shared.runtime import service_main

DESCRIPTION = (
    "DRA scheduler of the local cluster: generates claims from templates and extended resources, "
    "allocates devices from ResourceSlices, reserves claims and binds pods; frees claims of finished pods."
)


class SchedulerConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    kubeconfig: str = ""
    resync_seconds: float = 30.0
    cel_cpu_seconds: Annotated[
        float,
        msgspec.Meta(
            gt=0,
            description="CPU time one CEL selector evaluation may use in the CEL worker before it fails with "
            "'actual cost limit exceeded'",
        ),
    ] = CPU_LIMIT_S


async def run(cfg: SchedulerConfig, stopping: asyncio.Event) -> None:
    async with await kube_api_client(cfg.kubeconfig) as api:
        await Scheduler(api, resync_seconds=cfg.resync_seconds, cel_cpu_seconds=cfg.cel_cpu_seconds).run(stopping)


def main(argv: list[str] | None = None) -> int:
    return service_main(
        SchedulerConfig,
        argv,
        prog="gpu-dra scheduler",
        description=DESCRIPTION,
        service=lambda cfg: "scheduler",
        run=run,
    )
