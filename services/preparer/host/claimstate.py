"""The per-claim state machine every driver shares: the one writer of a claim's checkpoint states, CDI spec,
device metadata files and lifecycle events; a driver (`host.port.DriverPort`) plans and does the rest.

Owns, for one driver on one node: per-claim serialisation; idempotency (a `PrepareCompleted` claim returns
its checkpointed devices); the prepare (the `PrepareStarted` record from the driver's plan, written or
staged; written again at each `RECORD` the driver yields; the spec, the claim's own or one its shares use
together with other claims (`sharedspecs`); `PrepareCompleted`); unprepare (undo,
then forget); rollback of partial prepares (at start, when the kubelet abandons a prepare, soon after a
failed rollback, for stale claims); the claim fetch and the checks every driver makes (same UID, allocated,
pinned to this node, in this node's pool); a span per prepare and unprepare in the claim's trace; and
lifecycle events, each carried by the checkpoint write of the change it reports, with a `prepare-failed`
of its reason class for every failed prepare.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from services.preparer.host import metrics
from services.preparer.host.cdi import CdiWriter, build_spec
from services.preparer.host.checkpoint import Checkpoint, CheckpointError, ClaimRecord, PreparedDevice
from services.preparer.host.claims import (
    AllocationResult,
    ClaimNotFound,
    ClaimSource,
    ResourceClaim,
    selector_node_names,
)
from services.preparer.host.lifecycle import LifecycleEvents
from services.preparer.host.metadatafiles import MetadataFiles
from services.preparer.host.outbox import OutboxRecord
from services.preparer.host.port import (
    ClaimRef,
    DriverPort,
    Pending,
    Plan,
    PrepareFailed,
    SpecEdits,
    failure_reason,
)
from services.preparer.host.sharedspecs import SharedSpecs
from shared.backoff import Backoff
from shared.events.claims import ClaimEventKind, FailureReason, PreparedDeviceRef
from shared.keyedlocks import KeyedLocks
from shared.logs import get_logger
from shared.telemetry import (
    CLAIM_TRACEPARENT_ANNOTATION,
    KUBELET_CONTEXT,
    get_tracer,
    leaf_span,
    span_link,
    traceparent_context,
)

log = get_logger(__name__)
tracer = get_tracer(__name__)


@dataclass
class PrepareResult:
    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


class ClaimPreparer:
    """Prepare and unprepare one driver's claims on one node (see the module doc)."""

    def __init__(
        self,
        *,
        port: DriverPort,
        driver: str,
        node: str,
        claims: ClaimSource,
        cdi: CdiWriter,
        checkpoint: Checkpoint,
        events: LifecycleEvents,
        pool: str = "",
        metadata: MetadataFiles | None = None,
    ) -> None:
        self.port = port
        self.driver = driver
        self.node = node
        self.pool = pool or node
        self.claims = claims
        self.cdi = cdi
        self.metadata = metadata  # the device metadata files each claim's spec mounts; None: off
        self.checkpoint = checkpoint
        self.shared_specs = SharedSpecs(cdi, lambda: checkpoint.claims)
        self.events = events
        metrics.track_prepared(node, driver, checkpoint)  # gpu_dra_prepared_devices, counted when scraped
        if checkpoint.journal is None:
            checkpoint.journal = events.outbox  # checkpoint writes carry their events into the outbox
        self._locks: KeyedLocks[str] = KeyedLocks()  # per claim uid: one prepare, unprepare or rollback at a time
        # Set when a rollback failed (discovery slow or away): `retry_failed_rollbacks` tries again within
        # seconds, so a device is not held by a dead prepare until the periodic sweep.
        self.rollback_failed = asyncio.Event()

    # -- prepare ---------------------------------------------------------------------------
    async def prepare(self, ref: ClaimRef) -> PrepareResult:
        async with self._locks.hold(ref.uid):
            record = self.checkpoint.claims.get(ref.uid)
            if record is not None and record.state == "PrepareCompleted":
                return PrepareResult(devices=list(record.devices))
            started_after = self.checkpoint.preparation_seq
            try:
                devices = await self._prepare(ref, record)
            except PrepareFailed as exc:
                message = f"error preparing devices for claim {ref}: {exc}"
                log.warning("prepare failed", claim=str(ref), error=str(exc), reason=exc.reason)
                if not exc.reported:
                    await self._report_failure(ref, exc, started_after)
                return PrepareResult(error=message)
            except asyncio.CancelledError:
                # The kubelet gave up (its deadline passed, or it went away): nobody will use what this
                # prepare did, so undo it now, under the claim's lock, rather than at the next sweep.
                await asyncio.shield(self._abandon(ref))
                raise
            except Exception as exc:
                await self._report_failure(ref, PrepareFailed(str(exc), failure_reason(exc)), started_after)
                raise
            return PrepareResult(devices=devices)

    async def _prepare(self, ref: ClaimRef, previous: ClaimRecord | None) -> list[PreparedDevice]:
        """Read and check the claim, then the driver's prepare in the claim's span. A claim that fails the
        checks gets that span too (failed): in its trace when it is readable, the RPC's otherwise. The span
        starts before the read (its context comes from the claim), and its first event, `claim.get`, marks
        when the claim arrived (`dra.claim.get_ms`: how long the API server took), not a span of its own."""
        began = time.time_ns()
        try:
            claim = await self._fetch(ref)
        except PrepareFailed as exc:
            with self.claim_span(ref, exc.claim, start_time=began) as span:
                self._note_read(span, began)
                raise
        with self.claim_span(ref, claim, start_time=began) as span:
            self._note_read(span, began)
            devices = await self._prepare_claim(ref, previous, claim)
            self.describe_devices(span, devices)
            return devices

    async def _prepare_claim(
        self, ref: ClaimRef, previous: ClaimRecord | None, claim: ResourceClaim
    ) -> list[PreparedDevice]:
        """The driver's plan, its record, its side effects, the spec and `PrepareCompleted` (module doc)."""
        port = self.port
        if previous is not None and not port.resumable:  # a PrepareStarted left by a failed or interrupted attempt
            # Undone before this attempt plans (from the inventory). A dynamic MIG device the earlier attempt had
            # discovery create (its reply lost to a kill or a cancelled call) is live until this rollback
            # destroys it: a plan made first resolves it as an existing (static) MIG device, skips the
            # create, and completes the claim on the device the rollback then destroys.
            await self._rollback(ref.uid, previous, reason="retry after an interrupted prepare")
            previous = None
        plan = await port.plan(ref, claim, self._our_results(claim))
        if plan is None:  # no device of this driver in the claim: nothing to do, remembered as done
            now = time.time()
            await self.checkpoint.put(
                ref.uid,
                ClaimRecord(
                    state="PrepareCompleted",
                    name=ref.name,
                    namespace=ref.namespace,
                    preparation=self.checkpoint.next_preparation(),
                    started_at=now,
                    completed_at=now,
                ),
            )
            return []
        if previous is not None and not port.resumes(previous, plan):
            await self._rollback(ref.uid, previous, reason="retry of a claim recorded for another preparation")
            previous = None
        if previous is None:
            record = ClaimRecord(
                state="PrepareStarted",
                name=ref.name,
                namespace=ref.namespace,
                preparation=self.checkpoint.next_preparation(),
                devices=plan.devices,
                started_at=time.time(),
                configs=plan.configs,
                traceparent=self.claim_traceparent(claim),
                fabric_partition=plan.fabric_partition,
            )
            started = [self._event("prepare-started", ref, record)]
            if plan.record_first:  # a side effect a crash could leave behind comes first: on disk before it
                await self.checkpoint.put(ref.uid, record, events=started)
            else:  # nothing to leave behind yet: the next write carries it (`checkpoint` module doc)
                self.checkpoint.stage(ref.uid, record, events=started)
        else:
            record = previous  # resumed: the earlier attempt's side effects are still in place
        try:
            await self._complete(ref, claim, record, await self._apply(ref, claim, plan, record))
        except Pending:
            raise  # the record stays for the next call
        except Exception as exc:
            log.warning("prepare failed after it started; rolling back", claim=str(ref), error=str(exc))
            reason = failure_reason(exc)
            await self._rollback(ref.uid, record, reason=str(exc), failed=reason)
            raise PrepareFailed(str(exc), reason, reported=True) from None
        log.info("claim prepared", claim=str(ref), devices=[d.device for d in record.devices])
        return list(record.devices)

    async def _apply(self, ref: ClaimRef, claim: ResourceClaim, plan: Plan, record: ClaimRecord) -> SpecEdits:
        """Run the driver's side effects, writing the record whenever it asks; its CDI edits."""
        edits: SpecEdits | None = None
        async with contextlib.aclosing(self.port.apply(ref, claim, plan, record)) as steps:
            async for step in steps:
                if isinstance(step, SpecEdits):
                    edits = step
                else:
                    await self.checkpoint.put(ref.uid, record)
        assert edits is not None, "a driver's apply ends with its SpecEdits"
        return edits

    async def _complete(self, ref: ClaimRef, claim: ResourceClaim, record: ClaimRecord, edits: SpecEdits) -> None:
        """The metadata files, then the spec that mounts them, then `PrepareCompleted` with its event."""
        cdi_id: Callable[[str], str] | None = None  # a device's CDI id
        with leaf_span(tracer, "cdi.write"):
            metadata = self.metadata if edits.metadata else None  # a spec that mounts them is the claim's own
            if metadata is not None:
                await metadata.add_to(claim, edits.metadata, edits.devices)
            if edits.devices and edits.shared and metadata is None:
                digest = await self.shared_specs.use(ref.uid, record, edits.devices, edits.common)
                cdi_id = functools.partial(self.cdi.shared_device_id, digest)
            elif edits.devices:
                spec = build_spec(ref.uid, edits.devices, edits.common, self.cdi.cdi_kind)
                record.cdi_spec = await self.cdi.write(ref.uid, spec)
                cdi_id = functools.partial(self.cdi.device_id, ref.uid)
        for dev in record.devices:
            dev.cdi_device_ids = [cdi_id(dev.device)] if cdi_id else []
        record.state = "PrepareCompleted"
        record.completed_at = time.time()
        await self.checkpoint.put(ref.uid, record, events=[self._event("prepared", ref, record)])

    async def _abandon(self, ref: ClaimRef) -> None:
        """Roll back the PrepareStarted entry a cancelled prepare left (a step cut short by the
        cancellation still reached its side-effect record first, so the undo covers it), with its
        `prepare-failed` (reason `timeout`). If the undo fails the entry stays and is retried."""
        record = self.checkpoint.claims.get(ref.uid)
        if record is None or record.state != "PrepareStarted":
            return
        log.warning("prepare abandoned by the kubelet (deadline passed or client gone); rolling back", claim=str(ref))
        try:
            await self._rollback(
                ref.uid,
                record,
                reason="prepare abandoned: the kubelet's deadline passed or it went away",
                failed="timeout",
            )
        except PrepareFailed as exc:
            log.error(
                "rollback of an abandoned prepare failed; the periodic recovery retries it",
                claim=str(ref),
                error=str(exc),
            )

    async def _report_failure(self, ref: ClaimRef, exc: PrepareFailed, started_after: int) -> None:
        """Record the `prepare-failed` of an attempt that did not (it names the preparation this attempt
        started, if it got that far and the entry is still there; else a preparation of its own)."""
        current = self.checkpoint.claims.get(ref.uid)
        if current is not None and current.preparation > started_after:
            event = self._event("prepare-failed", ref, current, error=str(exc), reason=exc.reason)
        else:
            event = self.events.make(
                "prepare-failed",
                uid=ref.uid,
                namespace=ref.namespace,
                name=ref.name,
                preparation=self.checkpoint.next_preparation(),
                error=str(exc),
                reason=exc.reason,
            )
        try:
            await self.checkpoint.save(events=[event])
        except CheckpointError as err:
            log.error(
                "prepare-failed event not recorded: the checkpoint cannot be written", claim=str(ref), error=str(err)
            )

    @contextlib.contextmanager
    def claim_span(
        self, ref: ClaimRef, claim: ResourceClaim | None, *, start_time: int | None = None
    ) -> Iterator[trace.Span]:
        """The span `claim.prepare` in the claim's trace: linked to the scheduler's context on the claim
        (its `gpu.nvidia.com/traceparent`), and its child when the kubelet sent no context of its own
        (then linked back to this RPC's server span instead); with no claim (not readable) the RPC's
        child. A failure inside marks it: error status, the exception, `dra.failure.reason`."""
        traceparent = self.claim_traceparent(claim) if claim else ""
        links = span_link(traceparent)
        parent: otel_context.Context | None = None
        if links and not otel_context.get_value(KUBELET_CONTEXT):
            parent = traceparent_context(traceparent)
            server = trace.get_current_span().get_span_context()
            links = [trace.Link(server)] if server.is_valid else []
        attributes: dict[str, str | list[str]] = {
            "dra.claim.uid": ref.uid,
            "dra.claim.name": ref.name,
            "k8s.namespace.name": ref.namespace,
            "dra.driver": self.driver,
        }  # the node: the resource's k8s.node.name
        pods = [c.uid for c in claim.status.reservedFor if c.resource == "pods" and c.uid] if claim else []
        if pods:
            attributes["k8s.pod.uid"] = pods[0] if len(pods) == 1 else pods
        with tracer.start_as_current_span(
            "claim.prepare", context=parent, links=links, attributes=attributes, start_time=start_time
        ) as span:
            try:
                yield span
            except Exception as exc:
                span.set_attribute("dra.failure.reason", failure_reason(exc))
                raise

    @contextlib.contextmanager
    def _unprepare_span(self, ref: ClaimRef, record: ClaimRecord | None) -> Iterator[trace.Span]:
        """The span `claim.unprepare`: the RPC's child, with the claim's attributes and what it held."""
        attributes: dict[str, str | list[str]] = {
            "dra.claim.uid": ref.uid,
            "dra.claim.name": ref.name or (record.name if record else ""),
            "k8s.namespace.name": ref.namespace or (record.namespace if record else ""),
            "dra.driver": self.driver,
        }
        with tracer.start_as_current_span("claim.unprepare", attributes=attributes) as span:
            if record is not None:
                self.describe_devices(span, list(record.devices))
            yield span

    async def _link_claim_trace(
        self, span: trace.Span, ref: ClaimRef, record: ClaimRecord | None, timeout_s: float = 2.0
    ) -> None:
        """Link `span` to the claim's trace: from the context its record kept at prepare (none kept: the
        claim had none, or the record predates the field); for a claim not prepared here, read from the
        claim while it is still readable (best effort, bounded: a deleted claim or a slow API server leaves
        the span in the RPC's trace only)."""
        if not span.is_recording():
            return
        if record is not None:
            for link in span_link(record.traceparent):
                span.add_link(link.context)
            return
        if not ref.name:
            return
        try:
            claim = await asyncio.wait_for(self.claims.get(ref.namespace, ref.name), timeout_s)
        except Exception:  # noqa: BLE001 - gone or unreadable: no link, nothing else changes
            return
        if claim.metadata.uid == ref.uid:
            for link in span_link(self.claim_traceparent(claim)):
                span.add_link(link.context)

    @staticmethod
    def claim_traceparent(claim: ResourceClaim) -> str:
        """The claim's trace context (the scheduler's annotation), kept on its record for the unprepare."""
        return claim.metadata.annotations.get(CLAIM_TRACEPARENT_ANNOTATION, "")

    @staticmethod
    def describe_devices(span: trace.Span, devices: list[PreparedDevice]) -> None:
        """The prepared devices on a claim's span: names, GPU UUIDs, CDI ids."""
        if not span.is_recording():
            return
        span.set_attributes(
            {
                "dra.device": [d.device for d in devices],
                "gpu.uuid": [d.uuid for d in devices if d.uuid],
                "cdi.device_ids": [i for d in devices for i in d.cdi_device_ids],
            }
        )

    @staticmethod
    def _note_read(span: trace.Span, began: int) -> None:
        if span.is_recording():
            read = time.time_ns()
            span.add_event("claim.get", {"dra.claim.get_ms": round((read - began) / 1e6, 3)}, timestamp=read)

    async def _fetch(self, ref: ClaimRef) -> ResourceClaim:
        try:
            claim = await self.claims.get(ref.namespace, ref.name)
        except ClaimNotFound as exc:
            raise PrepareFailed(str(exc), "not-found") from None
        except Exception as exc:  # noqa: BLE001 - any fetch failure fails this claim, retried by the kubelet
            raise PrepareFailed(f"retrieve claim {ref.namespace}/{ref.name}: {exc}", failure_reason(exc)) from None
        if claim.metadata.uid != ref.uid:  # another claim of that name: its trace is not this one's
            raise PrepareFailed(
                f"claim {ref.namespace}/{ref.name} got replaced (UID {claim.metadata.uid}, "
                f"kubelet asked for {ref.uid})",
                "not-found",
            )
        if claim.status.allocation is None:
            raise PrepareFailed(f"claim {ref.namespace}/{ref.name} not allocated", "not-allocated", claim=claim)
        return claim

    def _our_results(self, claim: ResourceClaim) -> list[tuple[int, AllocationResult]]:
        """(index, result) of this driver's allocation results; refuses a claim allocated elsewhere."""
        allocation = claim.status.allocation
        assert allocation is not None
        pinned = selector_node_names(allocation.nodeSelector)
        if pinned is not None and self.node not in pinned:
            raise PrepareFailed(
                f"claim is allocated to node(s) {', '.join(sorted(pinned))}, not to this node {self.node}", "other-node"
            )
        ours: list[tuple[int, AllocationResult]] = []
        for index, result in enumerate(allocation.devices.results if allocation.devices else []):
            if result.driver != self.driver:
                continue
            if result.pool != self.pool:
                raise PrepareFailed(
                    f"device {result.pool}/{result.device} is in pool {result.pool!r}, not this "
                    f"node's pool {self.pool!r}: the claim is allocated to another node",
                    "other-node",
                )
            ours.append((index, result))
        return ours

    # -- unprepare and rollback ------------------------------------------------------------
    async def _undo(self, uid: str, record: ClaimRecord) -> None:
        """The driver's undo, then the claim's spec (a shared one: its use of it), then its metadata files
        (idempotent)."""
        await self.port.undo(uid, record)
        if not self.shared_specs.release(uid, record.cdi_spec):
            await self.cdi.remove(uid)  # a rename on the loop: no span of its own
        if self.metadata is not None:
            await self.metadata.remove(uid, [r for d in record.devices for r in d.requests])  # after the spec

    async def unprepare(self, ref: ClaimRef) -> str:
        """ "" on success (also for a claim never prepared here), else the reason to retry."""
        async with self._locks.hold(ref.uid):
            record = self.checkpoint.claims.get(ref.uid)
            with self._unprepare_span(ref, record) as span:
                await self._link_claim_trace(span, ref, record)
                if record is None:
                    span.set_attribute("dra.unprepare.noop", True)
                    log.info("unprepare noop: claim not found in checkpoint", claim=str(ref))
                    return ""
                try:
                    await self._undo(ref.uid, record)
                    await self.checkpoint.remove(
                        ref.uid,
                        events=[self._event("unprepared", ClaimRef(ref.uid, record.namespace, record.name), record)],
                    )
                except Exception as exc:  # noqa: BLE001 - the kubelet retries unprepare
                    span.record_exception(exc)
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    span.set_attribute("dra.failure.reason", failure_reason(exc))
                    log.warning("unprepare failed", claim=str(ref), error=str(exc))
                    return f"error unpreparing devices for claim {ref}: {exc}"
        return ""

    async def _rollback(
        self, uid: str, record: ClaimRecord, *, reason: str, failed: FailureReason | None = None
    ) -> None:
        """Undo a partial prepare and forget it; if undo fails the PrepareStarted entry stays for a later try.
        `failed`: the rollback ends a failed prepare, whose `prepare-failed` (of that class) goes with it."""
        try:
            await self._undo(uid, record)
        except Exception as exc:  # noqa: BLE001
            log.error("rollback of a partial prepare failed; will retry", claim_uid=uid, error=str(exc))
            self.rollback_failed.set()
            raise PrepareFailed(f"rollback of an earlier partial prepare failed: {exc}", failure_reason(exc)) from None
        ref = ClaimRef(uid, record.namespace, record.name)
        events = [self._event("rolled-back", ref, record, error=reason)]
        if failed is not None:
            events.append(self._event("prepare-failed", ref, record, error=reason, reason=failed))
        await self.checkpoint.remove(uid, events=events)
        log.info("partial prepare rolled back", claim=f"{record.namespace}/{record.name}:{uid}", reason=reason)

    async def recover(self, *, only_failed: bool = False) -> int:
        """Roll back PrepareStarted claims no prepare is working on: at start all of them (a crash
        interrupted them), later those whose rollback failed before. Returns how many were rolled back.
        A resumable driver's PrepareStarted is a prepare in progress: undone by unprepare or stale cleanup only."""
        if self.port.resumable:
            return 0
        done = 0
        for uid, record in list(self.checkpoint.by_state("PrepareStarted").items()):
            if only_failed and self._locks.locked(uid):
                continue
            done += await self._roll_back_unchanged(
                uid,
                record,
                "interrupted prepare found at start"
                if not only_failed
                else "partial prepare left by a failed rollback",
            )
        return done

    async def _roll_back_unchanged(self, uid: str, record: ClaimRecord, reason: str) -> int:
        """Under the claim's lock, roll `record` back if it is still the claim's; 1 when it was rolled back."""
        async with self._locks.hold(uid):
            if self.checkpoint.claims.get(uid) is not record:
                return 0  # prepared or rolled back meanwhile
            try:
                await self._rollback(uid, record, reason=reason)
            except PrepareFailed:
                return 0
            return 1

    async def sweep_specs(self) -> int:
        """At start, after `recover`: remove the CDI specs, then the metadata files, of claims the checkpoint does not
        hold (cdi module doc)."""
        removed = await self.cdi.sweep(set(self.checkpoint.claims), self.shared_specs.in_use())
        if removed:
            log.info(
                "CDI specs of claims not prepared here removed (left by a reboot or a crash)",
                driver=self.driver,
                specs=len(removed),
            )
        if self.metadata is not None and (gone := await self.metadata.sweep(set(self.checkpoint.claims))):
            log.info("device metadata files of claims not prepared here removed", files=len(gone))
        return len(removed)

    async def retry_failed_rollbacks(self, *, first_delay: float = 1.0, max_delay: float = 30.0) -> None:
        """Forever: after a rollback failed, try the PrepareStarted entries again, backing off while
        they keep failing (each undo is idempotent)."""
        backoff = Backoff(initial_s=first_delay, cap_s=max_delay)
        while True:
            await self.rollback_failed.wait()
            await asyncio.sleep(backoff.next())
            self.rollback_failed.clear()
            done = await self.recover(only_failed=True)
            if done:
                log.info("failed rollbacks retried", claims=done)
            if not self.rollback_failed.is_set():
                backoff.reset()

    async def cleanup_stale(self) -> int:
        """Roll back PrepareStarted claims whose ResourceClaim is gone or no longer allocated here."""
        done = 0
        for uid, record in list(self.checkpoint.by_state("PrepareStarted").items()):
            if self._locks.locked(uid) or not record.name:
                continue  # being prepared right now, or a legacy entry without a name
            try:
                claim = await self.claims.get(record.namespace, record.name)
                stale = (
                    claim.metadata.uid != uid
                    or claim.status.allocation is None
                    or not any(
                        r.driver == self.driver and r.pool == self.pool
                        for r in (claim.status.allocation.devices.results if claim.status.allocation.devices else [])
                    )
                )
            except ClaimNotFound:
                stale = True
            except Exception as exc:  # noqa: BLE001 - transient: next round
                log.info("stale-claim check deferred", claim_uid=uid, error=str(exc))
                continue
            if not stale:
                log.info("partially prepared claim not stale", claim=f"{record.namespace}/{record.name}")
                continue
            done += await self._roll_back_unchanged(uid, record, "stale claim (deleted or not allocated here)")
        return done

    # -- events ----------------------------------------------------------------------------
    def _event(
        self, event: ClaimEventKind, ref: ClaimRef, record: ClaimRecord, *, error: str = "", reason: FailureReason = ""
    ) -> OutboxRecord:
        """The event `event` of the preparation `record` is, for the checkpoint write that reports it."""
        refs = [
            PreparedDeviceRef(
                request=d.requests[0] if d.requests else "",
                pool=d.pool,
                device=d.device,
                uuid=d.uuid,
                sharing=d.sharing,
                cdi_device_ids=list(d.cdi_device_ids),
                share_id=d.share_id,
                consumed_capacity=dict(d.consumed_capacity),
                capacity=dict(d.capacity),
            )
            for d in record.devices
        ]
        return self.events.make(
            event,
            uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            preparation=record.preparation,
            devices=refs,
            error=error,
            reason=reason,
        )
