"""The `compute-domain.nvidia.com` driver: ComputeDomain channel claims -> IMEX channel devices.

Owns what a channel prepare does as a `host.port.DriverPort` (the claim state machine writes every record,
spec and event): the claim has one `channel-<n>` device (a `daemon-<n>` is refused: the node's agent runs
the IMEX daemon) and one opaque `ComputeDomainChannelConfig`; channel-0 exclusivity among this node's claims
of the same domain (upstream #641; another domain is refused by the agent); `PrepareStarted` on disk (with
the config: undo knows the domain), then the agent's join (`channelcore.ChannelPreparer.prepare`) until the
daemon is Ready; the CDI edits (`k8s.compute-domain.nvidia.com/claim`, device `<claimUID>-channel-0`): the
channel char devices and the domain's env. A daemon not Ready yet (or an agent that does not answer) is a
retryable error that keeps the claim `PrepareStarted` with its join in place, so the kubelet's next call
resumes the wait; such a claim is undone only by unprepare or stale cleanup. A permanent error rolls back.
Undo asks the agent to release the claim (the last one stops the daemon).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Coroutine
from pathlib import Path
from typing import Any

import msgspec

from services.computedomain.channelcore import (
    ChannelClaim,
    ChannelConfigError,
    ChannelError,
    ChannelPreparer,
    ComputeDomainChannelConfig,
    parse_channel_config,
)
from services.computedomain.crd import CHANNEL_CONFIG_KIND, DAEMON_DEVICE_CLASS
from services.preparer.host.cdi import CHANNEL_CDI, CdiDevice, DeviceNode
from services.preparer.host.checkpoint import ClaimRecord, PreparedDevice
from services.preparer.host.claims import AllocationResult, ResourceClaim
from services.preparer.host.devices import Inventory
from services.preparer.host.plugin import PluginContext
from services.preparer.host.port import (
    ClaimRecords,
    ClaimRef,
    Pending,
    Plan,
    PrepareFailed,
    Record,
    SpecEdits,
)
from shared.bus import Bus
from shared.logs import get_logger
from shared.telemetry import get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)

CHANNEL_FILE_MODE = 0o666


def _matches(names: list[str], request: str) -> bool:
    return request in names or request.split("/", 1)[0] in names


def domain_of(record: ClaimRecord) -> str:
    """The ComputeDomain UID a checkpointed channel claim belongs to ("" for a claim with no channel)."""
    for config in record.configs:
        if config.get("kind") == CHANNEL_CONFIG_KIND:
            return str(config.get("domainID") or "")
    return ""


class ChannelDriver:
    """Channel claims on one node, over the node's computedomain agent (see the module doc)."""

    # a PrepareStarted channel claim is a join waiting for its daemon, resumed by the kubelet's next prepare,
    # undone by unprepare or by stale-claim cleanup; never rolled back at start
    resumable = True

    def __init__(
        self,
        *,
        driver: str,
        node: str,
        records: ClaimRecords,
        inventory: Inventory,
        ready_timeout: float,
        request_timeout: float,
    ) -> None:
        self.driver = driver
        self.node = node
        self.records = records
        self.inventory = inventory
        self.ready_timeout = ready_timeout
        self.request_timeout = request_timeout
        self.channels: ChannelPreparer | None = None

    def attach(self, bus: Bus) -> None:
        self.channels = ChannelPreparer(
            bus, node=self.node, ready_timeout=self.ready_timeout, request_timeout=self.request_timeout
        )

    # -- planning ----------------------------------------------------------------------------
    async def plan(
        self, ref: ClaimRef, claim: ResourceClaim, results: list[tuple[int, AllocationResult]]
    ) -> Plan | None:
        if not results:
            return None  # no device of ours in the claim: nothing to do, remembered as done
        if len(results) != 1:
            raise PrepareFailed(
                f"a ComputeDomain channel claim has exactly one {self.driver} device; this one has "
                f"{len(results)} ({', '.join(r.device for _, r in results)})",
                "invalid-config",
            )
        _, result = results[0]
        if result.device.startswith("daemon-"):
            raise PrepareFailed(
                f"device {result.device} (class {DAEMON_DEVICE_CLASS}) is not prepared by this "
                "driver: the node's computedomain agent runs the IMEX daemon itself; workloads "
                "use the ComputeDomain's channel claim template",
                "invalid-config",
            )
        if not result.device.startswith("channel-"):
            raise PrepareFailed(
                f"device {result.device!r} is not a device this driver publishes (channel-0)", "invalid-config"
            )
        config = self._config_for(claim, result.request)
        if self.channels is None or self.inventory.current is None:
            raise PrepareFailed(
                f"not ready for channel claims yet on node {self.node} (NATS or discovery's "
                "inventory has not arrived); the kubelet retries",
                "device-busy",
            )
        self._guard(ref, result.device, config.domain_id)
        device = PreparedDevice(
            requests=[result.request.split("/", 1)[0]],
            pool=result.pool,
            device=result.device,
            kind="channel",
            admin_access=bool(result.adminAccess),
        )
        # on disk before the join: a crash leaves the claim to unprepare or stale cleanup
        return Plan(devices=[device], configs=[msgspec.to_builtins(config)], record_first=True, work=config)

    def resumes(self, previous: ClaimRecord, plan: Plan) -> bool:
        """The same domain: the agent still holds the join of the earlier attempt."""
        config: ComputeDomainChannelConfig = plan.work
        return domain_of(previous) == config.domain_id

    def _config_for(self, claim: ResourceClaim, request: str) -> ComputeDomainChannelConfig:
        """The request's ComputeDomainChannelConfig: class configs before claim configs, later over earlier,
        a config naming the request over one naming none."""
        allocation = claim.status.allocation
        assert allocation is not None
        entries = allocation.devices.config if allocation.devices else []
        ordered = [e for e in entries if e.source == "FromClass"] + [e for e in entries if e.source != "FromClass"]
        named, unnamed = None, None
        for position, entry in enumerate(ordered):
            if entry.opaque is None:
                raise PrepareFailed(
                    f"only opaque parameters are supported by this driver (config entry {position} has no 'opaque')",
                    "invalid-config",
                )
            if entry.opaque.driver != self.driver:
                continue
            names = list(entry.requests or [])
            if names and _matches(names, request):
                named = entry.opaque.parameters
            elif not names:
                unnamed = entry.opaque.parameters
        parameters = named if named is not None else unnamed
        if parameters is None:
            raise PrepareFailed(
                f"request {request!r} has no {CHANNEL_CONFIG_KIND} for {self.driver}: channel "
                "claims come from the ComputeDomain's ResourceClaimTemplate "
                "(spec.channel.resourceClaimTemplate.name), which carries it",
                "invalid-config",
            )
        try:
            return parse_channel_config(parameters if isinstance(parameters, dict) else msgspec.json.encode(parameters))
        except ChannelConfigError as exc:
            raise PrepareFailed(str(exc), "invalid-config") from None

    def _guard(self, ref: ClaimRef, device: str, domain: str) -> None:
        for uid, record, held in self.records.holders(device, exclude=ref.uid):
            if held.admin_access or domain_of(record) != domain:
                continue  # another domain: the agent answers with the one-domain-per-node error
            # The log names the holder; the reply (this claim's) does not: it may be another tenant's claim.
            log.warning(
                "device held by another claim",
                claim=str(ref),
                device=device,
                holder=f"{record.namespace}/{record.name}:{uid}",
            )
            raise PrepareFailed(
                f"requested device {device} is already allocated to a different claim of the "
                "same ComputeDomain on this node",
                "device-busy",
            )

    # -- prepare and undo --------------------------------------------------------------------
    async def apply(
        self, ref: ClaimRef, claim: ResourceClaim, plan: Plan, record: ClaimRecord
    ) -> AsyncGenerator[Record | SpecEdits, None]:
        """Join the domain at the agent and wait for its daemon; the channel devices and the domain's env."""
        config: ComputeDomainChannelConfig = plan.work
        channels, inventory = self.channels, self.inventory.current
        assert channels is not None and inventory is not None  # checked by `plan`
        channels.dev_root = Path(self.inventory.dev_root)
        channels.simulated = inventory.simulated
        try:
            with tracer.start_as_current_span("channel.prepare") as span:
                span.set_attribute("dra.compute_domain", config.domain_id)
                edits = await channels.prepare(ChannelClaim(ref.uid, ref.namespace, ref.name, config))
        except ChannelError as exc:
            if exc.retryable:
                log.info("channel not ready yet; the kubelet retries", claim=str(ref), error=str(exc))
                raise Pending(str(exc), "timeout") from None
            raise PrepareFailed(
                str(exc), "invalid-config" if isinstance(exc, ChannelConfigError) else "device-error"
            ) from None
        nodes = [
            DeviceNode(
                d.path,
                d.host_path,
                type="c",
                major=d.major,
                minor=d.minor,
                file_mode=CHANNEL_FILE_MODE,
                permissions="rw",
            )
            for d in edits.device_nodes
        ]
        # a node without NVLink fabric gets no IMEX channel, and no CDI device at all
        yield SpecEdits([CdiDevice(record.devices[0].device, nodes, env=list(edits.env))] if nodes else [])

    async def undo(self, uid: str, record: ClaimRecord) -> None:
        domain = domain_of(record)
        if domain:
            if self.channels is None:
                raise ChannelError(
                    f"NATS is not connected yet; cannot release claim {uid} at the computedomain agent (will retry)"
                )
            with tracer.start_as_current_span("channel.leave") as span:
                span.set_attribute("dra.compute_domain", domain)
                await self.channels.unprepare(uid, domain)


class ChannelPlugin:
    """The host's view of the channel driver: no extra gRPC services, the inventory and agent once NATS is there."""

    def __init__(self, ctx: PluginContext) -> None:
        cfg = ctx.cfg
        # dev root and simulation flag of the node (where /proc/devices and /dev live) come from discovery
        self.inventory = Inventory(cfg.node, ctx.plugin_dir / "inventory-cache.json", dev_root=cfg.dev_root)
        self.channels = ChannelDriver(
            driver=ctx.driver,
            node=cfg.node,
            records=ctx.checkpoint,
            inventory=self.inventory,
            ready_timeout=cfg.channel_ready_timeout,
            request_timeout=cfg.device_op_timeout,
        )
        self.preparer = ctx.preparer(self.channels, CHANNEL_CDI)

    async def start(self) -> None:
        await self.inventory.load_cache()
        await self.preparer.recover()
        await self.preparer.sweep_specs()

    def add_services(self, server: Any) -> None:
        return None

    def attach_bus(self, bus: Bus) -> dict[str, Coroutine[Any, Any, None]]:
        self.channels.attach(bus)
        return {"inventory-watch": self.inventory.follow(bus)}
