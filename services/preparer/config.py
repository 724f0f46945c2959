"""Preparer settings: flags and `GPU_DRA_*` environment variables -> PreparerConfig, with derived defaults."""

from __future__ import annotations

import os
import socket
from typing import Annotated

import msgspec

from shared import nodeconfig
from shared.config import CommonConfig, ConfigError, load_config
from shared.deviceclasses import CD_DRIVER, GPU_DRIVER

DRIVERS = (GPU_DRIVER, CD_DRIVER)
DESCRIPTION = (
    "The kubelet DRA plugins for gpu.nvidia.com and compute-domain.nvidia.com (each on its own "
    "registration and DRA sockets): prepare/unprepare, CDI, checkpoint."
)


def _h(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class PreparerConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    node: Annotated[str, _h("this node's name (default: NODE_NAME, else the host name)")] = ""
    drivers: Annotated[
        list[str], _h(f"DRA drivers to serve, comma-separated, each on its own sockets ({', '.join(DRIVERS)})")
    ] = msgspec.field(default_factory=lambda: list(DRIVERS))
    registry_dir: Annotated[str, _h("kubelet plugin registration directory")] = "/var/lib/kubelet/plugins_registry"
    plugins_dir: Annotated[str, _h("kubelet plugins directory (holds <driver>/dra.sock and checkpoint.json)")] = (
        "/var/lib/kubelet/plugins"
    )
    cdi_dir: Annotated[str, _h("CDI spec directory")] = "/var/run/cdi"
    driver_root: Annotated[
        str,
        _h(
            "host path of the NVIDIA driver root whose userspace every GPU claim's CDI spec mounts (/, or "
            "/run/nvidia/driver with the GPU operator); unset: / is probed and, without a driver there, specs "
            "carry device nodes only"
        ),
    ] = ""
    container_driver_root: Annotated[
        str, _h("where this process sees the driver root, when it is mounted elsewhere (default: --driver-root)")
    ] = ""
    dev_root: Annotated[
        str, _h("host root of /dev for CDI host paths (default: --driver-root if set, else what discovery reports)")
    ] = ""
    cdi_hook_path: Annotated[str, _h("host path of nvidia-cdi-hook (NVIDIA container toolkit) named in CDI hooks")] = (
        "/usr/bin/nvidia-cdi-hook"
    )
    boot_id_path: Annotated[str, _h("file holding the kernel boot id")] = "/proc/sys/kernel/random/boot_id"
    sys_root: Annotated[
        str,
        _h("where the host's /sys is (sys/bus/pci for VFIO passthrough; a simulated node's tree in the local cluster)"),
    ] = "/"
    proc_root: Annotated[str, _h("where the host's /proc is (proc/<pid>/fd: is a GPU in use before passthrough)")] = "/"
    modprobe: Annotated[str, _h("command run as `<modprobe> vfio_pci` when the vfio-pci driver is absent")] = "modprobe"
    vfio_free_timeout: Annotated[
        float,
        msgspec.Meta(gt=0, description=("seconds a passthrough prepare waits for the processes holding the GPU to go")),
    ] = 60.0
    kubeconfig: Annotated[str, _h("kubeconfig file (default: in-cluster, else KUBECONFIG or ~/.kube/config)")] = ""
    node_config: Annotated[
        str,
        _h(
            "the NodeConfig YAML file the publisher is given (--node-config there), read once; empty: the NodeConfig "
            "objects (resource.nvidia.com), watched. A GPU's time-slice interval comes from it"
        ),
    ] = ""
    cleanup_interval: Annotated[float, msgspec.Meta(gt=0, description="seconds between stale-claim cleanups")] = 600.0
    device_op_timeout: Annotated[float, msgspec.Meta(gt=0, description="seconds to wait for discovery")] = 30.0
    healthcheck_port: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=65535,
            description=(
                "TCP port of the gRPC health service (grpc.health.v1, for the kubelet's grpc probe; NVIDIA's chart "
                "uses 51516); 0 is off"
            ),
        ),
    ] = 0
    outbox_max_events: Annotated[
        int,
        msgspec.Meta(
            gt=0,
            description=(
                "lifecycle events the outbox (<plugins>/<driver>/outbox.jsonl) holds while NATS is away; past it, new "
                "events are dropped (gpu_dra_outbox_dropped_total, an error log)"
            ),
        ),
    ] = 100_000
    outbox_max_bytes: Annotated[
        int,
        msgspec.Meta(
            gt=0,
            description=(
                "bytes of pending lifecycle events the outbox holds while NATS is away (see --outbox-max-events)"
            ),
        ),
    ] = 64 << 20
    channel_ready_timeout: Annotated[
        float,
        msgspec.Meta(
            gt=0,
            description=(
                "seconds a ComputeDomain channel prepare waits for the node's IMEX daemon to be Ready before it "
                "answers with a retryable error (the kubelet calls again)"
            ),
        ),
    ] = 20.0

    def resolved(self) -> PreparerConfig:
        node = self.node or os.environ.get("NODE_NAME", "") or socket.gethostname()
        return msgspec.structs.replace(self, node=node)


def parse(argv: list[str], env: dict[str, str] | None = None) -> PreparerConfig:
    cfg = load_config(PreparerConfig, argv, prog="gpu-dra preparer", description=DESCRIPTION, env=env)
    required = ("registry_dir", "plugins_dir", "cdi_dir")
    for name in (
        *required,
        "driver_root",
        "container_driver_root",
        "dev_root",
        "cdi_hook_path",
        "sys_root",
        "proc_root",
    ):
        if (name in required or getattr(cfg, name)) and not os.path.isabs(getattr(cfg, name)):
            raise ConfigError(f"--{name.replace('_', '-')} must be an absolute path, got {getattr(cfg, name)!r}")
    if cfg.node_config:
        try:
            nodeconfig.load(cfg.node_config)
        except nodeconfig.NodeConfigError as exc:
            raise ConfigError(f"--node-config: {exc}") from None
    unknown = [d for d in cfg.drivers if d not in DRIVERS]
    if unknown or not cfg.drivers or len(set(cfg.drivers)) != len(cfg.drivers):
        raise ConfigError(
            f"--drivers must name each of {', '.join(DRIVERS)} at most once (at least one), "
            f"got {','.join(cfg.drivers)!r}"
        )
    return cfg.resolved()


__all__ = ["DRIVERS", "ConfigError", "PreparerConfig", "parse"]
