"""The `compute-domain.nvidia.com` driver plugin: ComputeDomain channel claims -> IMEX channel devices.

Owns what a channel prepare does inside the shared claim state machine (`claimstate.ClaimPreparer`):
  1. the claim has exactly one device of this driver, a `channel-<n>` (upstream's `daemon-<n>` type is
     refused: the node's computedomain agent runs the IMEX daemon, no daemon pod claims it), and one
     opaque `ComputeDomainChannelConfig` (as the controller's workload ResourceClaimTemplate has it);
  2. channel-0 exclusivity among this node's claims of the same domain (upstream #641); a claim of
     another domain is left to the agent, which refuses it with "one ComputeDomain at a time";
  3. `PrepareStarted` (with the config, so unprepare knows the domain), then
     `services.computedomain.channelcore.ChannelPreparer.prepare`: the agent joins, the daemon becomes Ready;
  4. the CDI spec (kind `k8s.compute-domain.nvidia.com/claim`, device `<claimUID>-channel-0`) with the
     channel char devices and the domain's env, then `PrepareCompleted`.
A daemon that is not Ready yet (or an agent that does not answer) is a retryable per-claim error and
the claim stays `PrepareStarted` with the agent's join in place, so the kubelet's next call resumes
the wait instead of restarting the daemon; such a claim is not an interrupted prepare to roll back at
start, only on unprepare or when the claim is gone (stale cleanup). A permanent error (another domain
on this node, a bad config, the wrong namespace) rolls back. Unprepare asks the agent to release the
claim (the last one stops the daemon) and removes the CDI spec.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from services.computedomain.channelcore import (
    ChannelClaim,
    ChannelConfigError,
    ChannelEdits,
    ChannelError,
    ChannelPreparer,
    ComputeDomainChannelConfig,
    parse_channel_config,
)
from services.computedomain.crd import CHANNEL_CONFIG_KIND, DAEMON_DEVICE_CLASS
from services.preparer.cdi import CHANNEL_CDI, CdiDevice, CdiWriter, ContainerEdits, DeviceNode, build_spec
from services.preparer.checkpoint import ClaimRecord, PreparedDevice
from services.preparer.claims import AllocationResult, ResourceClaim
from services.preparer.claimstate import ClaimPreparer, ClaimRef, PrepareFailed, failure_reason
from services.preparer.devices import Inventory
from services.preparer.drivers import PluginContext
from shared.bus import Bus
from shared.events.claims import FailureReason
from shared.logs import get_logger
from shared.telemetry import get_tracer, leaf_span

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


class ChannelClaimPreparer(ClaimPreparer):
    """Channel claims on one node, over the node's computedomain agent (see the module doc)."""

    def __init__(self, *, inventory: Inventory, ready_timeout: float, request_timeout: float,
                 **base: Any) -> None:
        super().__init__(**base)
        self.inventory = inventory
        self.ready_timeout = ready_timeout
        self.request_timeout = request_timeout
        self.channels: ChannelPreparer | None = None

    def attach(self, bus: Bus) -> None:
        self.channels = ChannelPreparer(bus, node=self.node, ready_timeout=self.ready_timeout,
                                        request_timeout=self.request_timeout)

    async def recover(self, *, only_failed: bool = False) -> int:
        """Nothing is rolled back here: a PrepareStarted channel claim is a join waiting for its daemon,
        resumed by the kubelet's next prepare, undone by unprepare or by stale-claim cleanup."""
        return 0

    # -- planning ----------------------------------------------------------------------------
    def _plan(self, claim: ResourceClaim) -> tuple[AllocationResult, ComputeDomainChannelConfig] | None:
        ours = self._our_results(claim)
        if not ours:
            return None
        if len(ours) != 1:
            raise PrepareFailed(f"a ComputeDomain channel claim has exactly one {self.driver} device; this one has "
                                f"{len(ours)} ({', '.join(r.device for _, r in ours)})", "invalid-config")
        _, result = ours[0]
        if result.device.startswith("daemon-"):
            raise PrepareFailed(f"device {result.device} (class {DAEMON_DEVICE_CLASS}) is not prepared by this "
                                "driver: the node's computedomain agent runs the IMEX daemon itself; workloads "
                                "use the ComputeDomain's channel claim template", "invalid-config")
        if not result.device.startswith("channel-"):
            raise PrepareFailed(f"device {result.device!r} is not a device this driver publishes (channel-0)",
                                "invalid-config")
        return result, self._config_for(claim, result.request)

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
                raise PrepareFailed(f"only opaque parameters are supported by this driver (config entry {position} "
                                    "has no 'opaque')", "invalid-config")
            if entry.opaque.driver != self.driver:
                continue
            names = list(entry.requests or [])
            if names and _matches(names, request):
                named = entry.opaque.parameters
            elif not names:
                unnamed = entry.opaque.parameters
        parameters = named if named is not None else unnamed
        if parameters is None:
            raise PrepareFailed(f"request {request!r} has no {CHANNEL_CONFIG_KIND} for {self.driver}: channel "
                                "claims come from the ComputeDomain's ResourceClaimTemplate "
                                "(spec.channel.resourceClaimTemplate.name), which carries it", "invalid-config")
        try:
            return parse_channel_config(parameters if isinstance(parameters, dict) else msgspec.json.encode(parameters))
        except ChannelConfigError as exc:
            raise PrepareFailed(str(exc), "invalid-config") from None

    def _guard(self, ref: ClaimRef, device: str, domain: str) -> None:
        for uid, record, held in self.checkpoint.holders(device, exclude=ref.uid):
            if held.admin_access or domain_of(record) != domain:
                continue  # another domain: the agent answers with the one-domain-per-node error
            # The log names the holder; the reply (this claim's) does not: it may be another tenant's claim.
            log.warning("device held by another claim", claim=str(ref), device=device,
                        holder=f"{record.namespace}/{record.name}:{uid}")
            raise PrepareFailed(f"requested device {device} is already allocated to a different claim of the "
                                "same ComputeDomain on this node", "device-busy")

    # -- prepare -----------------------------------------------------------------------------
    async def _prepare_claim(self, ref: ClaimRef, previous: ClaimRecord | None,
                             claim: ResourceClaim) -> list[PreparedDevice]:
        plan = self._plan(claim)
        if plan is None:  # no device of ours in the claim: nothing to do, remembered as done
            record = ClaimRecord(state="PrepareCompleted", name=ref.name, namespace=ref.namespace,
                                 preparation=self.checkpoint.next_preparation(), started_at=time.time(),
                                 completed_at=time.time())
            await self.checkpoint.put(ref.uid, record)
            return []
        result, config = plan
        channels = self.channels
        if channels is None or self.inventory.current is None:
            raise PrepareFailed(f"not ready for channel claims yet on node {self.node} (NATS or discovery's "
                                "inventory has not arrived); the kubelet retries", "device-busy")
        self._guard(ref, result.device, config.domain_id)
        if previous is not None and domain_of(previous) != config.domain_id:
            await self._rollback(ref.uid, previous, reason="retry of a claim recorded for another domain")
            previous = None
        if previous is None:
            record = ClaimRecord(
                state="PrepareStarted", name=ref.name, namespace=ref.namespace, started_at=time.time(),
                devices=[PreparedDevice(requests=[result.request.split("/", 1)[0]], pool=result.pool,
                                        device=result.device, kind="channel", admin_access=bool(result.adminAccess))],
                configs=[msgspec.to_builtins(config)], traceparent=self.claim_traceparent(claim))
            await self.checkpoint.put(ref.uid, record, events=[self._event("prepare-started", ref, record)])
        else:
            record = previous  # resume: the agent still holds the join of the earlier attempt
        channels.dev_root = Path(self.inventory.dev_root)
        channels.simulated = self.inventory.current.simulated
        try:
            with tracer.start_as_current_span("channel.prepare") as span:
                span.set_attribute("dra.compute_domain", config.domain_id)
                edits = await channels.prepare(ChannelClaim(ref.uid, ref.namespace, ref.name, config))
        except ChannelError as exc:
            if exc.retryable:
                log.info("channel not ready yet; the kubelet retries", claim=str(ref), error=str(exc))
                raise PrepareFailed(str(exc), "timeout") from None
            await self._fail(ref, record, str(exc), "invalid-config" if isinstance(exc, ChannelConfigError)
                             else "device-error")
        try:
            await self._complete(ref, record, edits)
        except Exception as exc:  # noqa: BLE001 - CDI or checkpoint write failed: undo the whole claim
            await self._fail(ref, record, str(exc), failure_reason(exc))
        log.info("channel claim prepared", claim=str(ref), domain=config.domain_id,
                 channels=len(edits.device_nodes), cdi=record.cdi_spec or "(none: no NVLink fabric)")
        return list(record.devices)

    async def _complete(self, ref: ClaimRef, record: ClaimRecord, edits: ChannelEdits) -> None:
        with leaf_span(tracer, "cdi.write"):
            nodes = [DeviceNode(d.path, d.host_path, type="c", major=d.major, minor=d.minor,
                                file_mode=CHANNEL_FILE_MODE, permissions="rw") for d in edits.device_nodes]
            device = record.devices[0]
            if nodes:  # a node without NVLink fabric gets no IMEX channel, and no CDI device at all
                spec = build_spec(ref.uid, [CdiDevice(device.device, nodes, env=list(edits.env))], ContainerEdits(),
                                  CHANNEL_CDI)
                record.cdi_spec = await self.cdi.write(ref.uid, spec)
                device.cdi_device_ids = [self.cdi.device_id(ref.uid, device.device)]
        record.state = "PrepareCompleted"
        record.completed_at = time.time()
        await self.checkpoint.put(ref.uid, record, events=[self._event("prepared", ref, record)])

    async def _fail(self, ref: ClaimRef, record: ClaimRecord, reason: str, kind: FailureReason) -> NoReturn:
        """A permanent failure: release the claim at the agent, forget it, tell the kubelet why.
        (A failed rollback leaves the claim PrepareStarted: the next call or unprepare tries again.)"""
        log.warning("channel claim failed; rolling back", claim=str(ref), error=reason)
        try:
            await self._rollback(ref.uid, record, reason=reason, failed=kind)
        except PrepareFailed as exc:
            log.warning("channel claim rollback failed; will retry", claim=str(ref), error=str(exc))
            raise PrepareFailed(reason, kind) from None  # prepare() records its prepare-failed
        raise PrepareFailed(reason, kind, reported=True)

    # -- unprepare ---------------------------------------------------------------------------
    async def _undo(self, uid: str, record: ClaimRecord) -> None:
        domain = domain_of(record)
        if domain:
            if self.channels is None:
                raise ChannelError(f"NATS is not connected yet; cannot release claim {uid} at the computedomain "
                                   "agent (will retry)")
            with tracer.start_as_current_span("channel.leave") as span:
                span.set_attribute("dra.compute_domain", domain)
                await self.channels.unprepare(uid, domain)
        await self.cdi.remove(uid)  # a rename on the loop: no span of its own


class ChannelPlugin:
    """The host's view of the channel driver: no extra gRPC services, the inventory and agent once NATS is there."""

    def __init__(self, ctx: PluginContext) -> None:
        cfg = ctx.cfg
        # dev root and simulation flag of the node (where /proc/devices and /dev live) come from discovery
        self.inventory = Inventory(cfg.node, ctx.plugin_dir / "inventory-cache.json", dev_root=cfg.dev_root)
        cdi = CdiWriter(Path(cfg.cdi_dir), CHANNEL_CDI, durable=not ctx.checkpoint.power_loss_is_reboot)
        self.preparer = ChannelClaimPreparer(
            driver=ctx.driver, node=cfg.node, claims=ctx.claims, cdi=cdi,
            checkpoint=ctx.checkpoint, events=ctx.events, inventory=self.inventory,
            ready_timeout=cfg.channel_ready_timeout, request_timeout=cfg.device_op_timeout)

    async def start(self) -> None:
        await self.inventory.load_cache()
        await self.preparer.recover()
        await self.preparer.sweep_specs()

    def add_services(self, server: Any) -> None:
        return None

    def attach_bus(self, bus: Bus) -> dict[str, Coroutine[Any, Any, None]]:
        self.preparer.attach(bus)
        return {"inventory-watch": self.inventory.follow(bus)}
