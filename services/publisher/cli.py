"""`gpu-dra publisher`: flags -> PublisherConfig -> the service, until SIGINT/SIGTERM.

Exit codes: 0 after a clean stop, 2 for a bad setting, 3 when the API server cannot be reached or
does not serve resource.k8s.io v1/v1beta1.
"""

from __future__ import annotations

import asyncio

from services.publisher import config
from services.publisher.apiversion import ApiDiscoveryError
from services.publisher.service import run_service
from shared.heap import fewer_young_collections
from shared.kube.client import KubeConfigError, kube_api_client
from shared.runtime import connected_bus, service_main


async def _run(cfg: config.PublisherConfig, stopping: asyncio.Event) -> None:
    fewer_young_collections()  # this process: 64 workers' requests in flight over a fleet's cache
    api = await kube_api_client(
        cfg.kubeconfig,
        url=cfg.api_url,
        token=cfg.api_token,
        ca_file=cfg.api_ca_file,
        insecure_skip_tls_verify=cfg.api_insecure_skip_tls_verify,
    )
    try:
        async with connected_bus(cfg, f"publisher-{cfg.replica_id}") as bus:
            await run_service(cfg, bus, api, stopping)
    finally:
        await api.close()


def main(argv: list[str] | None = None) -> int:
    return service_main(
        config.PublisherConfig,
        argv,
        prog="gpu-dra publisher",
        description=config.DESCRIPTION,
        parse=config.parse,
        service=lambda cfg: "publisher",
        run=_run,
        failures=((ApiDiscoveryError, 3), (KubeConfigError, 3)),
    )
