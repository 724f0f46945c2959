"""`gpu-dra kubelet`: the kubelet emulator for one node — flags -> config -> plugin watcher + pod loop."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path

from kubernetes_asyncio import client
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.nodeagent.plugins import PluginRegistry
from embedded.nodeagent.pods import PodRunner
from shared.config import CommonConfig, ConfigError, load_config
from shared.logs import get_logger
from shared.runtime import prepare_process, run_until_stopped

log = get_logger(__name__)
DESCRIPTION = ("Kubelet emulator: registers DRA plugins from the registry dir, prepares the claims of pods "
               "bound to this node over the real gRPC sockets, and runs those pods.")


class KubeletConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    node: str
    kubeconfig: str = ""
    registry_dir: str = "/var/lib/kubelet/plugins_registry"
    cdi_dir: str = "/var/run/cdi"
    require_driver: str = "gpu.nvidia.com"  # the node is Ready once this driver is registered
    resync_seconds: float = 30.0


async def set_node_ready(core: client.CoreV1Api, node: str, ready: bool, message: str) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    body = {"status": {"conditions": [{
        "type": "Ready", "status": "True" if ready else "False", "lastHeartbeatTime": now,
        "lastTransitionTime": now, "reason": "KubeletReady" if ready else "KubeletNotReady", "message": message}],
        "nodeInfo": {"kubeletVersion": "v1.34.0-gpu-dra-emulator", "machineID": node, "systemUUID": node,
                     "bootID": node, "kernelVersion": "", "osImage": "gpu-dra simulated node",
                     "containerRuntimeVersion": "cdi://emulated", "kubeProxyVersion": "",
                     "operatingSystem": "linux", "architecture": "amd64"}}}
    with contextlib.suppress(ApiException):
        await core.patch_node_status(node, body)


async def run(cfg: KubeletConfig, stopping: asyncio.Event) -> None:
    api_cfg = client.Configuration()
    await kube_config.load_kube_config(config_file=cfg.kubeconfig or None, client_configuration=api_cfg)
    async with client.ApiClient(api_cfg) as api:
        core = client.CoreV1Api(api)
        plugins = PluginRegistry(Path(cfg.registry_dir))
        runner = PodRunner(cfg.node, api, plugins, [Path(cfg.cdi_dir)], resync_seconds=cfg.resync_seconds)
        watcher = asyncio.create_task(plugins.run(stopping))
        wake = asyncio.Event()

        async def readiness() -> None:
            ready: bool | None = None
            while not stopping.is_set():
                now_ready = cfg.require_driver in plugins.drivers() if cfg.require_driver else True
                if now_ready != ready:
                    ready = now_ready
                    await set_node_ready(core, cfg.node, ready, f"DRA drivers: {sorted(plugins.drivers())}")
                wake.set()  # pods waiting for a driver get another go
                plugins.changed.clear()
                waits = [asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(plugins.changed.wait())]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()

        ready_task = asyncio.create_task(readiness())
        try:
            await runner.run(stopping, wake)
        finally:
            for task in (watcher, ready_task):
                task.cancel()
            await asyncio.gather(watcher, ready_task, return_exceptions=True)
            await set_node_ready(core, cfg.node, False, "kubelet emulator stopped")
            await plugins.close()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(KubeletConfig, list(sys.argv[1:] if argv is None else argv), prog="gpu-dra kubelet",
                          description=DESCRIPTION)
    except ConfigError as exc:
        print(f"gpu-dra kubelet: {exc}", file=sys.stderr)
        return 2
    prepare_process(cfg, f"kubelet-{cfg.node}")
    asyncio.run(run_until_stopped(lambda stopping: run(cfg, stopping)))
    return 0
