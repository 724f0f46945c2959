"""`gpu-dra up`: flags -> ClusterConfig -> a running local cluster until Ctrl-C; nothing else."""

from __future__ import annotations

import asyncio
import sys

from embedded.cluster.local import ClusterConfig, LocalCluster, cluster_main
from shared.runtime import stop_event

DESCRIPTION = ("A local GPU cluster: embedded NATS, the embedded API server, and per simulated node a "
               "discovery, a preparer and a kubelet emulator, plus the publisher, scheduler and controllers.")


async def _up(cfg: ClusterConfig) -> int:
    stopping = stop_event()
    async with LocalCluster(cfg, progress=lambda line: print(f"  {line}", flush=True)) as cluster:
        print(f"\nready: {len(cluster.node_names)} node(s) x {cfg.machine or cfg.gpus}", flush=True)
        print(f"  export KUBECONFIG={cluster.kubeconfig_path}", flush=True)
        print(f"  logs in {cluster.data_dir / 'logs'}; Ctrl-C stops everything", flush=True)
        failed = cluster.supervisor.failed if cluster.supervisor else asyncio.get_running_loop().create_future()
        stopper = asyncio.ensure_future(stopping.wait())
        await asyncio.wait({stopper, failed}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if failed.done():
            child = failed.result()
            print(f"gpu-dra up: {child.name} exited; last lines of {child.log_path}:\n{child.tail()}",
                  file=sys.stderr)
            return 1
        print("stopping...", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cluster_main(ClusterConfig, argv, prog="gpu-dra up", description=DESCRIPTION, run=_up)
