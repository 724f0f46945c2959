"""`gpu-dra up`: flags -> ClusterConfig -> a running local cluster until Ctrl-C; nothing else."""

from __future__ import annotations

import asyncio
import sys

from embedded.cluster.local import ClusterConfig, LocalCluster
from embedded.cluster.processes import ProcessFailed
from shared.config import ConfigError, load_config
from shared.logs import setup_logging
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
    try:
        cfg = load_config(ClusterConfig, list(sys.argv[1:] if argv is None else argv), prog="gpu-dra up",
                          description=DESCRIPTION)
    except ConfigError as exc:
        print(f"gpu-dra up: {exc}", file=sys.stderr)
        return 2
    if cfg.nodes < 1:
        print("gpu-dra up: --nodes must be at least 1", file=sys.stderr)
        return 2
    setup_logging("gpu-dra-up", "warning" if cfg.log_level == "info" else cfg.log_level, cfg.log_format)
    try:
        return asyncio.run(_up(cfg))
    except ProcessFailed as exc:
        print(f"gpu-dra up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
