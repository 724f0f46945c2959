"""`gpu-dra publisher`: flags -> PublisherConfig -> the service, until SIGINT/SIGTERM.

Owns argument handling and exit codes: 0 after a clean stop, 2 for a bad setting, 3 when the API
server cannot be reached or does not serve resource.k8s.io v1/v1beta1.
"""

from __future__ import annotations

import asyncio
import sys

from services.publisher import config
from services.publisher.apiversion import ApiDiscoveryError
from services.publisher.service import run_service
from shared.config import ConfigError
from shared.kubeclient import kube_api_client
from shared.runtime import connected_bus, prepare_process, run_until_stopped


def _fail(msg: str, code: int) -> int:
    print(f"gpu-dra publisher: error: {msg}", file=sys.stderr)
    return code


async def _serve(cfg: config.PublisherConfig) -> int:
    prepare_process(cfg, "publisher")
    try:
        api = await kube_api_client(cfg.kubeconfig, url=cfg.api_url, token=cfg.api_token, ca_file=cfg.api_ca_file,
                                    insecure_skip_tls_verify=cfg.api_insecure_skip_tls_verify)
    except Exception as exc:  # noqa: BLE001 - kubeconfig and in-cluster loading raise many types
        return _fail(f"cannot configure the Kubernetes client: {exc}; give --kubeconfig or --api-url", 3)

    async def main(stopping: asyncio.Event) -> None:
        async with connected_bus(cfg, f"publisher-{cfg.replica_id}") as bus:
            await run_service(cfg, bus, api, stopping)

    try:
        await run_until_stopped(main)
    except ApiDiscoveryError as exc:
        return _fail(str(exc), 3)
    finally:
        await api.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config.parse(list(argv or []))
    except ConfigError as exc:
        return _fail(str(exc), 2)
    return asyncio.run(_serve(cfg))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
