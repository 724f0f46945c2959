"""The preparer-side core of driver `compute-domain.nvidia.com`: channel claims -> IMEX channel devices.

A plain async API that the preparer hosts behind its kubelet sockets:

    channels = ChannelPreparer(bus, node="n1", dev_root="/", ready_timeout=10.0)
    config = parse_channel_config(opaque_parameters_json)      # ChannelConfigError: permanent
    edits = await channels.prepare(ChannelClaim(uid, namespace, name, config))
        # -> ChannelEdits(device_nodes=[ChannelDevice...], env=[...]); CDI-ready via .to_cdi()
        # ChannelNotReady  (retryable): the node's IMEX daemon is not Ready yet; kubelet retries
        # ChannelConflict  (permanent): the node serves another ComputeDomain, or the clique is full
        # ChannelError     (permanent unless .retryable): anything else, with what to do
    await channels.unprepare(claim_uid, domain_uid)               # idempotent

Prepare asks the node's agent to serve the domain (`dra.v1.cd-agent.<node>.join`; the agent starts
the IMEX daemon and joins the membership), then waits, bounded by `ready_timeout` and by watching
the member's KV entry (no polling), for the member to be Ready. Then it returns the channel device
nodes: `/dev/nvidia-caps-imex-channels/channel0`, or channel0..channel2047 for `allocationMode: All`
(2048 is the channel count per IMEX domain), char devices with the `nvidia-caps-imex-channels` major
from `<dev-root>/proc/devices`, minor = channel, mode 0666. A node without NVLink fabric gets none.
Idempotency and checkpointing are the preparer's; calling prepare again for a prepared claim is safe.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from services.computedomain.crd import CHANNEL_CONFIG_KIND, CONFIG_API_VERSION
from services.computedomain.membership import Membership, token, wait_for_status
from shared.bus import Bus, BusError
from shared.events.catalog import CD_AGENT_JOIN, CD_AGENT_LEAVE
from shared.events.computedomain import JoinReply, JoinRequest, LeaveRequest
from shared.logs import get_logger

log = get_logger(__name__)

CHANNEL_COUNT = 2048
CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"
CHANNEL_MAJOR_NAME = "nvidia-caps-imex-channels"
SIMULATED_CHANNEL_MAJOR = 511  # for simulated nodes whose /proc/devices has no IMEX channel driver


class ChannelError(RuntimeError):
    """A channel claim could not be prepared; `retryable` says whether kubelet should try again."""

    retryable = False


class ChannelConfigError(ChannelError):
    """The opaque ComputeDomainChannelConfig is malformed."""


class ChannelConflict(ChannelError):
    """The node already serves another ComputeDomain (or the domain's clique is full)."""


class ChannelNotReady(ChannelError):
    """The local IMEX daemon is not Ready yet."""

    retryable = True


class ComputeDomainChannelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The opaque config the controller puts in the workload ResourceClaimTemplate."""

    domain_id: str = msgspec.field(name="domainID")
    allocation_mode: Literal["Single", "All", ""] = msgspec.field(name="allocationMode", default="Single")
    kind: str = CHANNEL_CONFIG_KIND
    api_version: str = msgspec.field(name="apiVersion", default=CONFIG_API_VERSION)

    @property
    def all_channels(self) -> bool:
        return self.allocation_mode == "All"


def channel_config(domain_uid: str, allocation_mode: str = "Single") -> dict[str, Any]:
    """The opaque parameters object for a domain (what the controller writes)."""
    return {
        "apiVersion": CONFIG_API_VERSION,
        "kind": CHANNEL_CONFIG_KIND,
        "domainID": domain_uid,
        "allocationMode": allocation_mode,
    }


def parse_channel_config(parameters: bytes | str | dict[str, Any]) -> ComputeDomainChannelConfig:
    """Strictly decode the opaque parameters; unknown fields and a wrong kind are errors."""
    try:
        if isinstance(parameters, dict):
            config = msgspec.convert(parameters, ComputeDomainChannelConfig)
        else:
            config = msgspec.json.decode(parameters, type=ComputeDomainChannelConfig)
    except RecursionError:
        raise ChannelConfigError(f"{CHANNEL_CONFIG_KIND} nests too deeply; it is one flat object") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ChannelConfigError(
            f"strict decoding error in {CHANNEL_CONFIG_KIND}: {exc}; expected "
            "{apiVersion: resource.nvidia.com/v1beta1, kind: ComputeDomainChannelConfig, domainID, allocationMode}"
        ) from None
    if config.kind != CHANNEL_CONFIG_KIND:
        raise ChannelConfigError(f"opaque config kind {config.kind!r} is not {CHANNEL_CONFIG_KIND}")
    if config.api_version != CONFIG_API_VERSION:
        raise ChannelConfigError(f"{CHANNEL_CONFIG_KIND} apiVersion {config.api_version!r} is not {CONFIG_API_VERSION}")
    if not config.domain_id:
        raise ChannelConfigError(f"{CHANNEL_CONFIG_KIND}.domainID is empty; it must be the ComputeDomain UID")
    return config


@dataclass(frozen=True)
class ChannelClaim:
    uid: str
    namespace: str
    name: str
    config: ComputeDomainChannelConfig


@dataclass(frozen=True)
class ChannelDevice:
    path: str  # in the container
    host_path: str
    major: int
    minor: int

    def to_cdi(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "hostPath": self.host_path,
            "type": "c",
            "major": self.major,
            "minor": self.minor,
            "fileMode": 0o666,
            "permissions": "rw",
        }


@dataclass
class ChannelEdits:
    domain_uid: str
    domain_name: str
    domain_namespace: str
    clique_id: str
    index: int
    device_nodes: list[ChannelDevice] = field(default_factory=list)
    env: list[str] = field(default_factory=list)

    def to_cdi(self) -> dict[str, Any]:
        """CDI `containerEdits` for the claim's channel device."""
        edits: dict[str, Any] = {"env": list(self.env)}
        if self.device_nodes:
            edits["deviceNodes"] = [d.to_cdi() for d in self.device_nodes]
        return edits


def channel_major(proc_devices: Path) -> int | None:
    """The char major of `nvidia-caps-imex-channels` in a /proc/devices file, None when absent."""
    try:
        text = proc_devices.read_text()
    except FileNotFoundError:
        return None
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            in_char = False
        parts = line.split()
        if in_char and len(parts) == 2 and parts[1] == CHANNEL_MAJOR_NAME and parts[0].isdigit():
            return int(parts[0])
    return None


class ChannelPreparer:
    """Prepare and unprepare channel claims on one node (see the module doc)."""

    def __init__(
        self,
        bus: Bus,
        *,
        node: str,
        dev_root: str = "/",
        ready_timeout: float = 10.0,
        request_timeout: float = 10.0,
        simulated: bool = False,
    ) -> None:
        self.bus = bus
        self.node = node
        self.dev_root = Path(dev_root)
        self.ready_timeout = ready_timeout
        self.request_timeout = request_timeout
        self.simulated = simulated
        self.membership = Membership(bus)

    async def prepare(self, claim: ChannelClaim) -> ChannelEdits:
        config = claim.config
        try:
            reply: JoinReply = await self.bus.request(
                CD_AGENT_JOIN,
                JoinRequest(
                    domain_uid=config.domain_id,
                    claim_uid=claim.uid,
                    claim_namespace=claim.namespace,
                    claim_name=claim.name,
                ),
                timeout=self.request_timeout,
                node=token(self.node),
            )
        except BusError as exc:
            raise ChannelNotReady(f"the computedomain agent on node {self.node} did not answer: {exc}") from None
        if not reply.ok:
            if reply.error_code == "conflict":
                raise ChannelConflict(reply.error)
            if reply.error_code == "unavailable":
                raise ChannelNotReady(reply.error)
            raise ChannelError(reply.error or f"agent refused the claim ({reply.error_code})")
        try:
            member = await wait_for_status(self.membership, config.domain_id, self.node, "Ready", self.ready_timeout)
        except BusError as exc:
            raise ChannelNotReady(
                f"NATS did not answer while node {self.node} waited for its ComputeDomain membership: {exc}; "
                "kubelet retries"
            ) from None
        if member is None:
            raise ChannelNotReady(
                f"error asserting ComputeDomain Ready: node {self.node} not ready in ComputeDomain "
                f"{reply.domain_namespace}/{reply.domain_name} within {self.ready_timeout:g}s (its IMEX daemon "
                "is connecting to its peers); kubelet retries"
            )
        edits = ChannelEdits(
            domain_uid=config.domain_id,
            domain_name=reply.domain_name,
            domain_namespace=reply.domain_namespace,
            clique_id=member.clique_id,
            index=member.index,
        )
        if member.clique_id == "":
            return edits  # no NVLink fabric: no IMEX, no channel devices
        major = await asyncio.to_thread(channel_major, self.dev_root / "proc" / "devices")
        if major is None:
            if not self.simulated:
                raise ChannelError(
                    f"no {CHANNEL_MAJOR_NAME} entry in {self.dev_root / 'proc' / 'devices'}: the NVIDIA driver's "
                    "IMEX channel support is not loaded on this node (driver >= 570.158.01 is needed)"
                )
            major = SIMULATED_CHANNEL_MAJOR
        channels = range(CHANNEL_COUNT) if config.all_channels else range(1)
        host_dir = self.dev_root / CHANNEL_DIR.lstrip("/")
        edits.device_nodes = [
            ChannelDevice(
                path=f"{CHANNEL_DIR}/channel{i}", host_path=str(host_dir / f"channel{i}"), major=major, minor=i
            )
            for i in channels
        ]
        edits.env = [
            f"COMPUTE_DOMAIN_UUID={config.domain_id}",
            f"COMPUTE_DOMAIN_NAME={reply.domain_name}",
            f"COMPUTE_DOMAIN_NAMESPACE={reply.domain_namespace}",
            f"CLIQUE_ID={member.clique_id}",
        ]
        log.info(
            "channel claim prepared",
            claim=claim.uid,
            domain=config.domain_id,
            node=self.node,
            channels=len(edits.device_nodes),
        )
        return edits

    async def unprepare(self, claim_uid: str, domain_uid: str) -> bool:
        """Release the claim; True when it was the node's last claim of the domain (the daemon stopped)."""
        try:
            reply = await self.bus.request(
                CD_AGENT_LEAVE,
                LeaveRequest(domain_uid=domain_uid, claim_uid=claim_uid),
                timeout=self.request_timeout,
                node=token(self.node),
            )
        except BusError as exc:
            raise ChannelNotReady(f"the computedomain agent on node {self.node} did not answer: {exc}") from None
        if not reply.ok:
            raise ChannelError(reply.error)
        return bool(reply.left_domain)
