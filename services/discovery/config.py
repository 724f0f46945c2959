"""Discovery settings: flags and `GPU_DRA_*` environment variables → DiscoveryConfig.

Owns the setting names, defaults and the derived paths (dev root, state dir, MPS root).
`--driver-root` names where the driver's files are: on a real node NVML is loaded from it; under
`--simulate/--machine` NVML stays simulated and only the driver's binaries (nvidia-smi,
nvidia-cuda-mps-control) are run from it, so the real time-slice and MPS code runs against
simulated GPUs (tests use a fake driver root). Simulation without a driver root runs no binary.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from shared import featuregates
from shared.config import CommonConfig, ConfigError, load_config

DEFAULT_IGNORED_XIDS = [13, 31, 43, 45, 68, 109]
MIN_TELEMETRY_INTERVAL_S = 0.2  # the most a node publishes: 5 samples a second (tests); deployments keep 10 s


DESCRIPTION = (
    "GPU discovery: the node's NVML handle (inventory, health, device operations). "
    "Sub-action: 'inject-xid --node N --device gpu-0 --xid 79'."
)
__all__ = ["ConfigError", "DiscoveryConfig", "parse"]


def simulated_state_dir(dev_root: str | Path) -> Path:
    """Where a simulated node keeps its state by default: under its fake root, as a real node's /var/lib."""
    return Path(dev_root) / "var" / "lib" / "gpu-dra"


def sim_state_file(state_dir: str | Path, node: str) -> Path:
    """The simulated NVML's state of `node` (read by the local cluster's nvidia-smi shim too)."""
    return Path(state_dir) / f"simnvml-{node}.json"


class DiscoveryConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    node: str = ""
    simulate: str = ""  # e.g. h100x8, a100-40gbx8:mig, h100x4+l40sx2
    machine: str = ""  # YAML machine file (simulation)
    driver_root: str = ""  # host driver root holding libnvidia-ml.so.1 and the driver's binaries
    container_driver_root: str = ""  # where this process sees the driver root, when mounted elsewhere
    cdi_hook_path: str = "/usr/bin/nvidia-cdi-hook"  # host path of nvidia-cdi-hook (same settings as the preparer)
    dev_root: str = ""  # where /dev and /proc live ("/" on real nodes; a fake tree under simulation)
    sys_root: str = ""  # where /sys lives (defaults to dev_root)
    state_dir: str = ""  # simulated NVML state, applied time-slices (see `resolved` for the defaults)
    mps_root: str = ""  # MPS pipe/shm/log dirs and daemon records (defaults to <state_dir>/mps)
    tool_timeout: float = 30.0  # seconds one run of a driver binary (nvidia-smi, MPS control) may take
    once: bool = False
    output: Literal["json"] = "json"
    rescan_interval: float = 30.0
    ignore_xids: list[int] = msgspec.field(default_factory=lambda: list(DEFAULT_IGNORED_XIDS))
    additional_xids_to_ignore: list[int] = msgspec.field(default_factory=list)
    event_timeout_ms: int = 1000
    telemetry_interval: Annotated[
        float,
        msgspec.Meta(
            description=(
                "seconds between utilisation samples (SM %, memory, power, temperature of every device), each "
                "published as one message on dra.v1.telemetry.<node>; 0 turns sampling off; at least "
                f"{MIN_TELEMETRY_INTERVAL_S} s"
            )
        ),
    ] = 10.0
    fabric_manager_partitions: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "NVLink partitions of Fabric Manager's shared NVSwitch mode: list them in the inventory (published as "
                "partition<N> attributes) and activate/deactivate them for claims (docs/nvlink-partitions.md)"
            )
        ),
    ] = False
    fabric_manager_tool: Annotated[
        str,
        msgspec.Meta(
            description=(
                "Fabric Manager's partition tool (NVIDIA's fmpm), looked up in the driver root's binary dirs; "
                "a simulated node without --driver-root uses the simulated Fabric Manager"
            )
        ),
    ] = "fmpm"
    fabric_manager_socket: Annotated[
        str,
        msgspec.Meta(
            description=(
                "host path of Fabric Manager's unix socket (FM_CMD_UNIX_SOCKET_PATH), under the driver root; "
                "'' for fmpm's default"
            )
        ),
    ] = "/run/nvidia-fabricmanager/socket"
    fabric_manager_address: Annotated[
        str, msgspec.Meta(description=("Fabric Manager's TCP address (FM_CMD_BIND_INTERFACE) instead of its socket"))
    ] = ""

    @property
    def local_driver_root(self) -> str:
        """Where this process reads the driver root ("" = the system's libnvidia-ml)."""
        return self.container_driver_root or self.driver_root

    @property
    def simulated(self) -> bool:
        return bool(self.simulate or self.machine)

    def resolved(self) -> DiscoveryConfig:
        """A copy with the derived defaults filled in."""
        node = self.node or os.environ.get("NODE_NAME", "") or socket.gethostname()
        dev_root = self.dev_root or (
            str(Path(os.environ.get("TMPDIR", "/tmp")) / "gpu-dra-sim" / node) if self.simulated else "/"
        )
        # Real nodes: under the kubelet plugins dir, the host path the node DaemonSet mounts writable.
        state_dir = self.state_dir or (
            str(simulated_state_dir(dev_root))
            if self.simulated
            else "/var/lib/kubelet/plugins/gpu.nvidia.com/discovery"
        )
        mps_root = self.mps_root or (
            str(Path(state_dir) / "mps") if self.simulated else "/var/lib/kubelet/plugins/gpu.nvidia.com/mps"
        )
        return msgspec.structs.replace(
            self,
            node=node,
            dev_root=dev_root,
            sys_root=self.sys_root or dev_root,
            state_dir=state_dir,
            mps_root=mps_root,
        )

    @property
    def runs_driver_tools(self) -> bool:
        """Whether time-slicing and MPS run the driver's binaries (a real node, or a driver root given)."""
        return bool(self.driver_root) or not self.simulated

    @property
    def ignored(self) -> set[int]:
        return set(self.ignore_xids) | set(self.additional_xids_to_ignore)


def parse(argv: list[str]) -> DiscoveryConfig:
    """Flags and GPU_DRA_* env → resolved config; ConfigError on anything unknown or malformed."""
    cfg = load_config(DiscoveryConfig, argv, prog="gpu-dra discovery", description=DESCRIPTION)
    if cfg.rescan_interval <= 0:
        raise ConfigError("--rescan-interval must be > 0")
    if cfg.simulate and cfg.machine:
        raise ConfigError("give either --simulate SPEC or --machine FILE, not both")
    if cfg.telemetry_interval < 0 or 0 < cfg.telemetry_interval < MIN_TELEMETRY_INTERVAL_S:
        raise ConfigError(f"--telemetry-interval must be 0 (off) or at least {MIN_TELEMETRY_INTERVAL_S} seconds")
    if cfg.tool_timeout <= 0:
        raise ConfigError("--tool-timeout must be > 0 seconds")
    if cfg.fabric_manager_partitions and not cfg.gates.enabled(featuregates.FABRIC_MANAGER_PARTITIONING):
        raise ConfigError(
            f"--fabric-manager-partitions needs --feature-gates "
            f"{featuregates.FABRIC_MANAGER_PARTITIONING}=true (an Alpha feature, off by default)"
        )
    return cfg.resolved()
