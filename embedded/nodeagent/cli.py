"""`gpu-dra kubelet`: the kubelet emulator for one node — flags -> config -> plugin watcher + pod loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kubernetes_asyncio import client

from embedded.nodeagent import nvidiasmi
from embedded.nodeagent.kubeletauth import KubeletAuth
from embedded.nodeagent.kubeletserver import KubeletServer
from embedded.nodeagent.node import NodeAgent
from embedded.nodeagent.plugins import PluginRegistry
from embedded.nodeagent.pods import PodRunner
from embedded.nodeagent.sandbox import Runtime, SandboxUnavailable, find_bwrap
from shared.config import CommonConfig
from shared.kube.client import kube_api_client
from shared.logs import get_logger
from shared.runtime import service_main

log = get_logger(__name__)
DESCRIPTION = (
    "Kubelet emulator: registers DRA plugins from the registry dir, prepares the claims of pods "
    "bound to this node over the real gRPC sockets, and runs those pods."
)


class KubeletConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    node: str
    kubeconfig: str = ""
    registry_dir: str = "/var/lib/kubelet/plugins_registry"
    cdi_dir: str = "/var/run/cdi"
    require_driver: str = "gpu.nvidia.com"  # the node is Ready once this driver is registered
    resync_seconds: float = 30.0
    state_dir: str = ""  # what it prepared, kept across restarts ("" = <registry-dir>/../gpu-dra-kubelet)
    heartbeat_seconds: float = 10.0
    runtime: str = "sandbox"  # sandbox: containers run under bubblewrap; none: not executed (status only)
    pod_log_dir: str = ""  # container logs, read by the API server's pods/log ("" = <state-dir>/pod-logs)
    sim_state: str = ""  # the simulated NVML state file the nvidia-smi shim answers from
    backoff_seconds: float = 10.0  # the first restart back-off (doubles up to 300 s), as the kubelet's


def container_runtime(cfg: KubeletConfig, state_dir: Path) -> Runtime | None:
    """The sandboxed runtime, or None (`--runtime none`, or bubblewrap missing: said loudly)."""
    if cfg.runtime == "none":
        return None
    if cfg.runtime != "sandbox":
        raise ValueError(f"--runtime {cfg.runtime!r}: expected sandbox or none")
    try:
        bwrap = find_bwrap()
    except SandboxUnavailable as exc:
        log.error("containers will not run (as with --runtime none)", node=cfg.node, error=str(exc))
        return None
    shim_dir = state_dir / "bin"
    nvidiasmi.install(shim_dir)
    return Runtime(
        bwrap=bwrap,
        work_root=state_dir / "pods",
        shim_dir=shim_dir,
        sim_state=cfg.sim_state,
        log_root=Path(cfg.pod_log_dir) if cfg.pod_log_dir else state_dir / "pod-logs",
        backoff_base=cfg.backoff_seconds,
    )


async def run(cfg: KubeletConfig, stopping: asyncio.Event) -> None:
    async with await kube_api_client(cfg.kubeconfig) as api:
        core = client.CoreV1Api(api)
        plugins = PluginRegistry(Path(cfg.registry_dir))
        state_dir = Path(cfg.state_dir) if cfg.state_dir else Path(cfg.registry_dir).parent / "gpu-dra-kubelet"
        state_dir = await asyncio.to_thread(state_dir.resolve)  # containers' dirs named by their real place
        runtime = await asyncio.to_thread(container_runtime, cfg, state_dir)
        runner = PodRunner(
            cfg.node,
            api,
            plugins,
            [Path(cfg.cdi_dir)],
            resync_seconds=cfg.resync_seconds,
            state_dir=state_dir,
            runtime=runtime,
            health=plugins.health,
        )
        kubelet_api = KubeletServer(KubeletAuth(api, cfg.node), lambda: runner.workers)
        agent = NodeAgent(core, api, cfg.node, await kubelet_api.start())
        watcher = asyncio.create_task(plugins.run(stopping))
        lease = asyncio.create_task(agent.heartbeat(stopping, cfg.heartbeat_seconds))
        wake = asyncio.Event()

        async def readiness() -> None:
            """Node status on every plugin change, and at least every heartbeat (lastHeartbeatTime)."""
            while not stopping.is_set():
                plugins.changed.clear()  # before looking, so a registration meanwhile is not missed
                wake.set()  # pods waiting for a driver get another go at once, not after the status write
                ready = cfg.require_driver in plugins.drivers() if cfg.require_driver else True
                await agent.set_ready(ready, f"DRA drivers: {sorted(plugins.drivers())}")
                waits = [asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(plugins.changed.wait())]
                await asyncio.wait(waits, timeout=cfg.heartbeat_seconds, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()

        ready_task = asyncio.create_task(readiness())
        try:
            await runner.run(stopping, wake)
        finally:
            for task in (watcher, ready_task, lease):
                task.cancel()
            await asyncio.gather(watcher, ready_task, lease, return_exceptions=True)
            await agent.set_ready(False, "kubelet emulator stopped")
            await plugins.close()
            await kubelet_api.close()


def main(argv: list[str] | None = None) -> int:
    return service_main(
        KubeletConfig,
        argv,
        prog="gpu-dra kubelet",
        description=DESCRIPTION,
        service=lambda cfg: f"kubelet-{cfg.node}",
        run=run,
    )
