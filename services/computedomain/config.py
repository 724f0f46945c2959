"""ComputeDomain settings: flags and `GPU_DRA_*` variables -> ControllerConfig and AgentConfig."""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Annotated, Literal

import msgspec

from services.computedomain.imex import ImexError, parse_signal
from services.computedomain.membership import MAX_PER_CLIQUE
from shared.config import CommonConfig, ConfigError
from shared.driverroot import DriverRoot, DriverRootError


def _h(text: str, **limits: float) -> msgspec.Meta:
    return msgspec.Meta(description=text, **limits)  # type: ignore[call-overload, no-any-return]


_REQUIRE = _h(
    "count a node's membership only while the controller has assigned its domain to the node (from the "
    "ResourceClaims allocated there); the controller writes the assignments, and controller and agents "
    "must agree on this setting"
)


class ControllerConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    kubeconfig: Annotated[str, _h("kubeconfig file (default: in-cluster, else KUBECONFIG or ~/.kube/config)")] = ""
    identity: Annotated[str, _h("leader-election identity (default: POD_NAME or host name, plus a random suffix)")] = ""
    leader_election: Annotated[bool, _h("elect a leader through a coordination.k8s.io Lease")] = True
    lease_namespace: Annotated[str, _h("namespace of the Lease (default: POD_NAMESPACE, else default)")] = ""
    lease_name: Annotated[str, _h("name of the Lease")] = "gpu-dra-computedomain-controller"
    lease_duration: Annotated[float, _h("seconds a leader holds the Lease without renewing", gt=0)] = 15.0
    renew_deadline: Annotated[float, _h("seconds a leader keeps trying to renew before it steps down", gt=0)] = 10.0
    retry_period: Annotated[float, _h("seconds between Lease attempts", gt=0)] = 2.0
    deletion_timeout: Annotated[float, _h("seconds to wait for agents to leave a deleted domain", gt=0)] = 10.0
    require_assignment: Annotated[bool, _REQUIRE] = False

    def resolved(self) -> ControllerConfig:
        if not self.renew_deadline < self.lease_duration:
            raise ConfigError(
                f"--renew-deadline ({self.renew_deadline}) must be below --lease-duration ({self.lease_duration})"
            )
        if not self.retry_period < self.renew_deadline:
            raise ConfigError(
                f"--retry-period ({self.retry_period}) must be below --renew-deadline ({self.renew_deadline})"
            )
        return msgspec.structs.replace(
            self,
            identity=self.identity or os.environ.get("POD_NAME", "") or socket.gethostname(),
            lease_namespace=self.lease_namespace or os.environ.get("POD_NAMESPACE", "") or "default",
        )


class AgentConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    node: Annotated[str, _h("this node's name (default: NODE_NAME, else the host name)")] = ""
    ip_address: Annotated[str, _h("the address IMEX daemons use on this node (default: POD_IP, else the host's)")] = ""
    state_dir: Annotated[str, _h("where domain files and agent state live")] = (
        "/var/lib/kubelet/plugins/compute-domain.nvidia.com"
    )
    driver_root: Annotated[
        str, _h("host path of the NVIDIA driver root (/, or /run/nvidia/driver with the GPU operator)")
    ] = "/"
    container_driver_root: Annotated[str, _h("where this container sees --driver-root (default: the same path)")] = ""
    imex_daemon: Annotated[
        Literal["real", "simulated"],
        _h("real: nvidia-imex from the driver root; simulated: the simulator (the local cluster)"),
    ] = "real"
    imex_command: Annotated[
        str,
        _h(
            "IMEX daemon command; {config} is its config file (default: nvidia-imex -c "
            "{config} from the driver root, or the simulator)"
        ),
    ] = ""
    imex_check_command: Annotated[
        str,
        _h(
            "readiness command printing READY (default: nvidia-imex-ctl -c {config} "
            "-q from the driver root; the simulator: its status lines)"
        ),
    ] = ""
    imex_check_interval: Annotated[float, _h("seconds between readiness checks", gt=0)] = 1.0
    imex_reload_signal: Annotated[
        str, _h("signal that tells the daemon its peers changed (nvidia-imex: SIGUSR1 restarts its connections)")
    ] = "SIGUSR1"
    imex_signal_spacing: Annotated[
        float,
        _h(
            "least seconds between two reload signals to nvidia-imex (it ignores "
            "a SIGUSR1 within 5 s of the last); later changes are coalesced",
            ge=0,
        ),
    ] = 5.0
    imex_peer_mode: Annotated[
        Literal["dns", "ip"],
        _h(
            "dns: peers as compute-domain-daemon-NNNN in --hosts-file, the daemon signalled on change; "
            "ip: peers' IPs in the nodes file, the daemon restarted on change"
        ),
    ] = "dns"
    hosts_file: Annotated[
        str, _h("the hosts file the real daemon resolves peer names with; the agent owns a marked block in it")
    ] = "/etc/hosts"
    imex_server_port: Annotated[int, _h("IMEX peer port", ge=1, le=65535)] = 50000
    imex_cmd_port: Annotated[int, _h("IMEX command port", ge=1, le=65535)] = 50005
    max_nodes_per_imex_domain: Annotated[int, _h("IMEX nodes per clique", ge=1, le=99)] = MAX_PER_CLIQUE
    require_assignment: Annotated[bool, _REQUIRE] = False

    def resolved(self) -> AgentConfig:
        node = self.node or os.environ.get("NODE_NAME", "") or socket.gethostname()
        ip = self.ip_address or os.environ.get("POD_IP", "")
        if not ip:
            try:
                ip = socket.gethostbyname(socket.gethostname())
            except OSError:
                ip = "127.0.0.1"
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise ConfigError(f"--ip-address {ip!r} is not an IP address") from None
        if not os.path.isabs(self.state_dir):
            raise ConfigError(f"--state-dir must be an absolute path, got {self.state_dir!r}")
        if not os.path.isabs(self.hosts_file):
            raise ConfigError(f"--hosts-file must be an absolute path, got {self.hosts_file!r}")
        try:
            DriverRoot.of(self.driver_root, self.container_driver_root)
            parse_signal(self.imex_reload_signal)
        except (DriverRootError, ImexError) as exc:
            raise ConfigError(str(exc)) from None
        return msgspec.structs.replace(self, node=node, ip_address=ip)
