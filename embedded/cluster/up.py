"""`gpu-dra up`: flags -> ClusterConfig -> a running local cluster until Ctrl-C; nothing else."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from embedded.cluster.local import ClusterConfig, LocalCluster, cluster_main
from shared.health import HEALTH
from shared.runtime import stop_event

DESCRIPTION = ("A local GPU cluster: embedded NATS, the embedded API server, and per simulated node a "
               "discovery, a preparer and a kubelet emulator, plus the publisher, scheduler and controllers. "
               "A service that dies is restarted with backoff; run again on the same --data-dir, it resumes.")


async def _up(cfg: ClusterConfig) -> int:
    # Until ready, a signal cancels the start (cluster_main); from then on it ends the wait below.
    async with LocalCluster(cfg, progress=lambda line: print(f"  {line}", flush=True)) as cluster:
        stopping = stop_event()
        HEALTH.add_check("every process of the cluster runs", cluster.running)  # /readyz on --metrics-port
        print(f"\nready: {len(cluster.node_names)} node(s) x {cfg.machine or cfg.gpus}", flush=True)
        if cluster.dashboard_url:
            print(f"  fleet page: {cluster.dashboard_url}", flush=True)
        print(f"  export KUBECONFIG={cluster.kubeconfig_path}", flush=True)
        nats_env = " ".join(f"{k}={v}" for k, v in cluster.nats_env().items())
        print(f"  export {nats_env}   # gpu-dra events tail", flush=True)
        print(f"  logs in {cluster.data_dir / 'logs'}; a service that exits is restarted; Ctrl-C stops everything",
              flush=True)
        assert cluster.supervisor is not None
        failed = cluster.supervisor.failed
        stopper: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
        await asyncio.wait({stopper, failed}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if failed.done():
            child = failed.result()
            print(f"gpu-dra up: {child.name} cannot be kept running; last lines of {child.log_path}:\n"
                  f"{child.tail()}", file=sys.stderr)
            return 1
        print("stopping...", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cluster_main(ClusterConfig, argv, prog="gpu-dra up", description=DESCRIPTION, run=_up)
