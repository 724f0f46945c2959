"""Publisher settings: flags and `GPU_DRA_*` environment variables -> PublisherConfig.

Owns the setting names, their defaults and the checks that need more than a type (positive
periods, a complete API endpoint). Everything else about a setting is in `shared.config`.
"""

from __future__ import annotations

import os
import socket
from typing import Annotated, Literal

import msgspec

from shared import featuregates, nodeconfig
from shared.config import CommonConfig, ConfigError, load_config

DESCRIPTION = (
    "ResourceSlice publisher: node inventories and device health (from NATS) become ResourceSlices "
    "for gpu.nvidia.com and compute-domain.nvidia.com. Run one or more replicas; nodes are shared out."
)
__all__ = ["ConfigError", "PublisherConfig", "parse"]


def _help(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class PublisherConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    kubeconfig: Annotated[
        str,
        _help("kubeconfig file; empty uses --api-url/--api-token, then in-cluster, then KUBECONFIG or ~/.kube/config"),
    ] = ""
    api_url: Annotated[str, _help("API server URL (instead of a kubeconfig)")] = ""
    api_token: Annotated[str, _help("bearer token for --api-url")] = ""
    api_ca_file: Annotated[str, _help("CA bundle for an https --api-url; empty uses the system's trust store")] = ""
    api_insecure_skip_tls_verify: Annotated[
        bool, _help("do not verify the certificate of an https --api-url (testing only; logged as a warning at start)")
    ] = False
    api_version: Annotated[
        Literal["auto", "v1", "v1beta1"], _help("resource.k8s.io version to write; auto discovers it")
    ] = "auto"
    counter_layout: Annotated[
        Literal["auto", "beside-devices", "counters-only-slice"],
        _help("where dynamic-MIG counter sets go: auto picks by server version (1.35+: counters-only slice)"),
    ] = "auto"
    mig_mode: Annotated[
        Literal["static", "dynamic"],
        _help("static: full GPUs or existing MIG devices; dynamic: partitionable devices with counters"),
    ] = "static"
    taint_effect: Annotated[
        Literal["NoSchedule", "NoExecute"], _help("effect of the taint an unhealthy device gets")
    ] = "NoSchedule"
    node_config: Annotated[
        str,
        _help(
            "a NodeConfig YAML file (examples/node-config/): how each node pool's GPUs are shared, read once; "
            "given, NodeConfig objects are ignored. Empty: the NodeConfig objects (resource.nvidia.com), watched "
            "and applied at once; none: every GPU exclusive"
        ),
    ] = ""
    compute_domains: Annotated[bool, _help("publish compute-domain.nvidia.com slices (channel-0, daemon-0)")] = True
    passthrough: Annotated[
        bool,
        _help(
            "offer every GPU without MIG for VFIO passthrough too (gpu-vfio-<minor>, class vfio.gpu.nvidia.com; shared "
            "counters give a GPU out one way at a time); a NodeConfig rule's passthrough decides per GPU"
        ),
    ] = False
    replica_id: Annotated[str, _help("this replica's name among publishers; default <host>-<pid>")] = ""
    heartbeat_seconds: Annotated[float, _help("how often a replica renews its membership")] = 1.0
    lease_seconds: Annotated[float, _help("a replica silent this long is gone; its nodes move")] = 5.0
    probe_seconds: Annotated[
        float,
        _help(
            "how often a replica asks NATS whether each peer is still connected; a peer whose connection is gone "
            "on two probes is gone at once, before its lease (0: the lease only)"
        ),
    ] = 0.5
    resync_seconds: Annotated[float, _help("full re-read of KV and slices (writes only what differs)")] = 60.0
    node_gone_grace: Annotated[
        float,
        _help(
            "seconds a Node must be gone from Kubernetes before its slices are deleted (an explicit withdrawal "
            "from the node's discovery deletes them at once; an empty or unreadable inventory never does)"
        ),
    ] = 300.0
    # 64: at 10,000 nodes a cold publish is bound by write latency, not CPU (14 s with 64, 23 s with 16;
    # bench/fleet_bench.py); 64 nodes x 2 pools stays within the client's pool of 100 connections
    workers: Annotated[int, msgspec.Meta(ge=1, le=256, description="nodes synced concurrently")] = 64

    def resolved(self) -> PublisherConfig:
        replica = self.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        return msgspec.structs.replace(self, replica_id=replica)


def parse(argv: list[str]) -> PublisherConfig:
    """Flags and GPU_DRA_* env -> resolved config; ConfigError on anything unknown or malformed."""
    cfg = load_config(PublisherConfig, argv, prog="gpu-dra publisher", description=DESCRIPTION)
    check(cfg)
    return cfg.resolved()


def check(cfg: PublisherConfig) -> None:
    """Cross-field checks; ConfigError names the setting and what it needs."""
    for name in ("heartbeat_seconds", "lease_seconds", "resync_seconds", "node_gone_grace"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(cfg, name)})")
    if cfg.lease_seconds <= cfg.heartbeat_seconds:
        raise ConfigError(
            f"--lease-seconds ({cfg.lease_seconds}) must exceed --heartbeat-seconds ({cfg.heartbeat_seconds}), "
            "or replicas would expire between heartbeats"
        )
    if cfg.probe_seconds < 0:
        raise ConfigError(f"--probe-seconds must be >= 0 (got {cfg.probe_seconds}; 0 turns the probes off)")
    if cfg.kubeconfig and cfg.api_url:
        raise ConfigError("give either --kubeconfig or --api-url, not both")
    if cfg.api_token and not cfg.api_url:
        raise ConfigError("--api-token needs --api-url")
    if (cfg.api_ca_file or cfg.api_insecure_skip_tls_verify) and not cfg.api_url:
        raise ConfigError(
            "--api-ca-file and --api-insecure-skip-tls-verify need --api-url (a kubeconfig carries its own CA)"
        )
    if cfg.api_ca_file and cfg.api_insecure_skip_tls_verify:
        raise ConfigError("give --api-ca-file or --api-insecure-skip-tls-verify, not both")
    if cfg.passthrough and not cfg.gates.enabled(featuregates.PASSTHROUGH_SUPPORT):
        raise ConfigError(
            f"--passthrough needs --feature-gates {featuregates.PASSTHROUGH_SUPPORT}=true (an Alpha "
            "feature, off by default)"
        )
    if cfg.node_config:
        try:
            nodeconfig.load(cfg.node_config)
        except nodeconfig.NodeConfigError as exc:
            raise ConfigError(f"--node-config: {exc}") from None
    if cfg.kubeconfig and not os.path.isfile(cfg.kubeconfig):
        raise ConfigError(f"--kubeconfig {cfg.kubeconfig!r} is not a readable file")
