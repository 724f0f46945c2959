"""`gpu-dra up`: flags -> ClusterConfig -> a running local cluster until Ctrl-C; nothing else."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from embedded.cluster.clustermain import cluster_main
from embedded.cluster.local import ClusterConfig, LocalCluster
from shared.health import HEALTH
from shared.runtime import stop_event

DESCRIPTION = (
    "A local GPU cluster: embedded NATS, the embedded API server, and per simulated node a "
    "discovery, a preparer and a kubelet emulator, plus the publisher, scheduler and controllers. "
    "A service that dies is restarted with backoff; run again on the same --data-dir, it resumes."
)


def ready_lines(cluster: LocalCluster) -> list[str]:
    """What a user needs to reach a running cluster: the fleet page, KUBECONFIG, NATS, the logs."""
    cfg = cluster.cfg
    lines = [f"ready: {len(cluster.node_names)} node(s) x {cfg.machine or cfg.gpus}"]
    if cluster.dashboard_url:
        lines.append(f"  fleet page: {cluster.dashboard_url}")
    lines.append(f"  export KUBECONFIG={cluster.kubeconfig_path}")
    nats_env = " ".join(f"{k}={v}" for k, v in cluster.nats_env().items())
    lines.append(f"  export {nats_env}   # gpu-dra events tail")
    lines.append(f"  logs in {cluster.data_dir / 'logs'}; a service that exits is restarted; Ctrl-C stops everything")
    return lines


async def serve_until_stopped(cluster: LocalCluster, announce: list[str]) -> int:
    """Print `announce` (once a signal stops it), then keep the cluster up until SIGINT/SIGTERM (0) or until a
    service cannot be kept running (1)."""
    stopping = stop_event()
    print("\n".join(announce), flush=True)
    HEALTH.add_check("every process of the cluster runs", cluster.running)  # /readyz on --metrics-port
    assert cluster.supervisor is not None
    failed = cluster.supervisor.failed
    stopper: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({stopper, failed}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if failed.done():
        child = failed.result()
        print(
            f"gpu-dra up: {child.name} cannot be kept running; last lines of {child.log_path}:\n{child.tail()}",
            file=sys.stderr,
        )
        return 1
    print("stopping...", flush=True)
    return 0


async def _up(cfg: ClusterConfig) -> int:
    # Until ready, a signal cancels the start (cluster_main); from then on it ends the wait (serve_until_stopped).
    async with LocalCluster(cfg, progress=lambda line: print(f"  {line}", flush=True)) as cluster:
        return await serve_until_stopped(cluster, ["", *ready_lines(cluster)])


def main(argv: list[str] | None = None) -> int:
    return cluster_main(ClusterConfig, argv, prog="gpu-dra up", description=DESCRIPTION, run=_up)
