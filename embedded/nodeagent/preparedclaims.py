"""What the kubelet emulator prepared on its node: the claims, their devices and the pods using each, kept in
the state file (`state.py`, written with group commit: pods prepared side by side share one write), and the DRA
calls that change them: `NodePrepareResources` for a claim not prepared yet (joining the claim's trace), and
`NodeUnprepareResources` once no pod uses a claim (a failure keeps the claim, to be retried)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from pathlib import Path

import msgspec
from opentelemetry import context as otel_context

from embedded.kubelet.client import Claim, PluginError, PreparedDevice
from embedded.nodeagent.podclaims import DraClient, PreparedClaim, PrepareFailed
from embedded.nodeagent.state import ClaimRecord, DeviceRecord, StateStore
from shared.logs import get_logger
from shared.telemetry import traceparent_context

log = get_logger(__name__)


class PreparedClaims:
    """This node's prepared claims; the caller holds its node-wide lock around `prepare` and `unprepare_unused`."""

    def __init__(self, node: str, dra: DraClient, state_dir: Path | None) -> None:
        self.node = node
        self.dra = dra
        self.store = StateStore(state_dir)
        self.by_uid: dict[str, PreparedClaim] = {}  # claim uid -> state
        self._save_lock = asyncio.Lock()
        self._changes = self._saved = 0  # changes to the prepared claims made / in the state file
        for rec in self.store.load():
            self.by_uid[rec.uid] = PreparedClaim(
                Claim(namespace=rec.namespace, uid=rec.uid, name=rec.name),
                set(rec.drivers),
                [PreparedDevice(**msgspec.structs.asdict(d)) for d in rec.devices],
                set(rec.pods),
            )
        if self.by_uid:
            log.info("re-learned prepared claims from the state file", node=node, claims=len(self.by_uid))

    async def save(self) -> None:
        """Write the state file with every change made so far; callers that come while a write is on its way
        share the next one (pods prepared side by side, one write)."""
        self._changes += 1
        wanted = self._changes
        async with self._save_lock:
            if self._saved >= wanted:
                return
            upto = self._changes
            await self.store.save(
                [
                    ClaimRecord(
                        namespace=s.ref.namespace,
                        uid=s.ref.uid,
                        name=s.ref.name,
                        drivers=sorted(s.drivers),
                        devices=[DeviceRecord(**asdict(d)) for d in s.devices],
                        pods=sorted(s.pods),
                    )
                    for s in self.by_uid.values()
                ]
            )
            self._saved = upto

    async def prepare(
        self, uid: str, wanted: dict[str, Claim], drivers_of: dict[str, set[str]], traceparents: dict[str, str]
    ) -> dict[str, PreparedClaim]:
        """NodePrepareResources for the claims not prepared yet, and the pod added to each (under the node-wide
        lock: a claim is never prepared twice); the caller saves the state file."""
        for claim_uid, ref in wanted.items():
            if claim_uid in self.by_uid:
                continue
            devices: list[PreparedDevice] = []
            for driver in sorted(drivers_of[claim_uid]):
                if driver not in self.dra.drivers():
                    raise PrepareFailed(f"driver {driver} is not registered on node {self.node}")
                traceparent = traceparents[claim_uid]
                token = otel_context.attach(traceparent_context(traceparent)) if traceparent else None
                try:
                    answer = (await self.dra.prepare(driver, [ref])).get(claim_uid)
                finally:
                    if token is not None:
                        otel_context.detach(token)
                if answer is None or answer.error:
                    raise PrepareFailed(
                        f"{driver} could not prepare {ref.namespace}/{ref.name}: "
                        f"{answer.error if answer else 'no answer'}"
                    )
                devices += answer.devices
            self.by_uid[claim_uid] = PreparedClaim(ref, drivers_of[claim_uid], devices)
        for claim_uid in wanted:
            self.by_uid[claim_uid].pods.add(uid)
        return {u: self.by_uid[u] for u in wanted}

    async def unprepare_unused(self, pod_uid: str) -> bool:
        ok = True
        changed = False
        for claim_uid, state in list(self.by_uid.items()):
            if pod_uid in state.pods:
                state.pods.discard(pod_uid)
                changed = True
            if state.pods:
                continue
            errors: list[str] = []
            for driver in sorted(state.drivers):
                try:
                    error = (await self.dra.unprepare(driver, [state.ref])).get(claim_uid, "")
                except PluginError as exc:
                    error = str(exc)
                if error:
                    errors.append(error)
            if errors:
                ok = False
                log.warning("unprepare failed; will retry", claim=state.ref.name, errors=errors)
                continue
            del self.by_uid[claim_uid]
            changed = True
            log.info("claim unprepared", node=self.node, claim=f"{state.ref.namespace}/{state.ref.name}")
        if changed:
            await self.save()
        return ok

    def orphans(self) -> bool:
        return any(not s.pods for s in self.by_uid.values())

    def holds(self, uid: str) -> bool:
        return any(uid in s.pods for s in self.by_uid.values())
