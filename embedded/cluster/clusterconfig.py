"""The local cluster's settings (`gpu-dra up`'s flags and GPU_DRA_* variables), checked at start, and what
they make of the services' command lines and shared settings."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from services.discovery import profiles
from services.discovery.machine import MachineError, parse_spec
from shared import featuregates, nodeconfig
from shared.config import CommonConfig
from shared.natsusers import check_node

# The settings every service shares with up (CommonConfig) that up gives each service its own way: the NATS
# identity (a user per service; with --nats-url, up's own as given), the log format (json, into the log files),
# the metrics port (one each after --metrics-port) and the feature gates (with those the flags imply). Every other
# common setting reaches every service as up got it (flag or environment): SHARED_SETTINGS.
NATS_IDENTITY = (
    "nats_user",
    "nats_password",
    "nats_creds",
    "nats_token_file",
    "nats_tls_ca",
    "nats_tls_cert",
    "nats_tls_key",
)
PER_SERVICE = frozenset({"nats_url", "log_format", "metrics_port", "feature_gates", *NATS_IDENTITY})
SHARED_SETTINGS = tuple(f.name for f in msgspec.structs.fields(CommonConfig) if f.name not in PER_SERVICE)


class ClusterConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    nodes: Annotated[int, msgspec.Meta(ge=1, description="simulated GPU nodes")] = 2
    gpus: Annotated[
        str,
        msgspec.Meta(
            description=(
                "the simulated GPUs of every node: <profile>x<count>[:mig][,clique=N] joined by '+' for one node "
                "(h100x4+l40sx2), SPEC;SPEC;... one per node (cycled); clique=N sets the NVLink clique "
                f"(gb200x4:clique=7); profiles: {', '.join(profiles.choices())}"
            )
        ),
    ] = "h100x8"
    machine: Annotated[
        str, msgspec.Meta(description=("YAML machine file (docs/discovery.md) for every node, instead of --gpus"))
    ] = ""
    kubeconfig: Annotated[
        str, msgspec.Meta(description=("where to write the admin kubeconfig; empty: <data-dir>/kubeconfig"))
    ] = ""
    data_dir: Annotated[
        str,
        msgspec.Meta(
            description=(
                "all state (API objects, logs, node dirs); run again on it to resume; empty: a temp dir removed on exit"
            )
        ),
    ] = ""
    node_prefix: Annotated[
        str, msgspec.Meta(description=("node names are <prefix><index>: lowercase letters, digits and '-'"))
    ] = "gpu-node-"
    node_config: Annotated[
        str,
        msgspec.Meta(
            description=(
                "a NodeConfig YAML file (examples/node-config/, docs/sharing.md), created (or replaced) as the "
                "NodeConfig object of its name, which the publisher watches: how each GPU is shared (exclusive, "
                "timeSlicing, mpsShares, shares); `kubectl apply` changes it live. Empty: no NodeConfig is made"
            )
        ),
    ] = ""
    dynamic_mig: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "publish MIG-capable GPUs as partitionable devices with counters (the publisher's --mig-mode dynamic)"
            )
        ),
    ] = False
    compute_domains: Annotated[
        bool, msgspec.Meta(description=("run a ComputeDomain agent (simulated IMEX daemon) on every node"))
    ] = True
    passthrough: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "offer every GPU without MIG for VFIO passthrough too (class vfio.gpu.nvidia.com; the publisher's "
                "--passthrough): a prepare moves the simulated GPU to vfio-pci in the node's fake sysfs"
            )
        ),
    ] = False
    nvlink_partitions: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "run each node's discovery with --fabric-manager-partitions: a simulated Fabric Manager offers the HGX "
                "partition table, GPUs publish partition<N> attributes, and a claim's partition is activated on "
                "prepare (docs/nvlink-partitions.md)"
            )
        ),
    ] = False
    start_timeout: Annotated[
        float, msgspec.Meta(gt=0, description=("seconds each start step (a node's inventory, a node Ready) may take"))
    ] = 90.0
    runtime: Annotated[
        str,
        msgspec.Meta(
            description=(
                "sandbox: each container's command runs under bubblewrap (read-only host root, no network, own PID "
                "namespace; logs, exits, restarts); none: containers are not executed, pods only show Running"
            )
        ),
    ] = "sandbox"
    dashboard: Annotated[
        bool, msgspec.Meta(description=("serve the live fleet page (gpu-dra dashboard, --auth none) and print its URL"))
    ] = True
    dashboard_port: Annotated[
        int, msgspec.Meta(ge=0, le=65535, description=("the fleet page's port on 127.0.0.1; 0: a free one"))
    ] = 0
    restart_backoff: Annotated[
        float,
        msgspec.Meta(
            gt=0, description=("seconds before a failed container's first restart (doubling up to 300, as the kubelet)")
        ),
    ] = 10.0

    def implied_gates(self) -> list[str]:
        """The gates the cluster's flags need: --passthrough PassthroughSupport, --nvlink-partitions
        FabricManagerPartitioning."""
        return [
            gate
            for gate, wanted in (
                (featuregates.PASSTHROUGH_SUPPORT, self.passthrough),
                (featuregates.FABRIC_MANAGER_PARTITIONING, self.nvlink_partitions),
            )
            if wanted
        ]

    def gate_setting(self) -> str:
        """The --feature-gates every service gets: the cluster's, with the gates its flags need turned on."""
        implied = [f"{gate}=true" for gate in self.implied_gates() if gate not in self.gates.overrides]
        return ",".join(filter(None, [self.feature_gates, *implied]))

    def node_spec(self, index: int) -> str:
        """The --simulate spec of node `index`: `--gpus` may list one per node, separated by ';'."""
        specs = [s.strip() for s in self.gpus.split(";") if s.strip()]
        return specs[index % len(specs)] if specs else self.gpus

    def __post_init__(self) -> None:
        # every node gets NATS users named after it, whose permissions name it as one subject token
        for index in {0, self.nodes - 1}:
            try:
                check_node(f"{self.node_prefix}{index}")
            except ValueError as exc:
                raise ValueError(
                    f"--node-prefix {self.node_prefix!r} makes node names a NATS user cannot be "
                    f"named after ({exc}); use lowercase letters, digits and '-'"
                ) from None
        if self.machine and not Path(self.machine).is_file():
            raise ValueError(f"--machine {self.machine!r} is not a file; give a YAML machine file (docs/discovery.md)")
        if not self.machine:
            for spec in {self.node_spec(index) for index in range(self.nodes)}:
                try:
                    parse_spec(spec)
                except MachineError as exc:
                    raise ValueError(f"--gpus {spec!r}: {exc}") from None
        for gate in self.implied_gates():
            if self.gates.overrides.get(gate) is False:
                raise ValueError(
                    f"--passthrough and --nvlink-partitions need their feature gates; the "
                    f"--feature-gates setting turns {gate} off"
                )
        if self.node_config:
            try:
                nodeconfig.load(self.node_config)
            except nodeconfig.NodeConfigError as exc:
                raise ValueError(f"--node-config: {exc}") from None
        if self.runtime not in ("sandbox", "none"):
            raise ValueError(f"--runtime {self.runtime!r}: use sandbox (containers run under bubblewrap) or none")


def publisher_argv(cfg: ClusterConfig) -> list[str]:
    """The publisher's command line for this cluster (its MIG flag is `--mig-mode static|dynamic`). The
    embedded API server validates slices by the 1.35 rules (a slice has devices or sharedCounters, not both)
    while /version says 1.34, so the publisher is told the layout rather than derive it: counters come with
    dynamic MIG and passthrough, whether from these flags or from a NodeConfig rule applied at any time."""
    argv = ["publisher", "--mig-mode", "dynamic" if cfg.dynamic_mig else "static"]
    argv += ["--counter-layout", "counters-only-slice"]
    return [*argv, "--passthrough"] if cfg.passthrough else argv
