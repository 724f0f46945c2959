"""Forged claim events against the example ledger (examples/ledger), on the shipped NATS users.

Node gpu-a's preparer user may publish claim events only on `dra.v1.claim.<ns>.gpu-a.<event>`; what
it writes in the body is its own choice. The ledger must take identity from the subject,
de-duplicate on the node-scoped event id (not on a header anyone can set), and bound body times by
the server's timestamp. Node gpu-b's events come from the preparer's real LifecycleEvents.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from examples.ledger import trust
from examples.ledger.consumer import LedgerService
from examples.ledger.schema import load_contract
from services.preparer.host.lifecycle import LifecycleEvents
from shared.bus import Bus
from shared.events import catalog
from shared.events.base import now_unix
from shared.events.claims import ClaimLifecycle, PreparedDeviceRef, claim_event_id
from shared.events.schema import write_schemas
from shared.identity import REASON
from shared.natsserver import EmbeddedNats
from tests.polling import eventually
from tests.preparer.helpers import send_all
from tests.security.conftest import DeadLetters, bus_as, url_as


@pytest.fixture
async def ledger(shipped_nats: EmbeddedNats, tmp_path: Path) -> AsyncIterator[LedgerService]:
    write_schemas(tmp_path / "schemas")
    service = LedgerService(
        url_as(shipped_nats, "admin"), load_contract(tmp_path / "schemas"), tmp_path / "ledger.json"
    )
    await service.start()
    task = asyncio.create_task(service.run())
    try:
        yield service
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await service.close()


def event(
    kind: str,
    uid: str,
    namespace: str,
    node: str,
    at: float,
    *,
    event_id: str | None = None,
    devices: tuple[str, ...] = ("gpu-0",),
) -> ClaimLifecycle:
    return ClaimLifecycle(
        event=kind,  # type: ignore[arg-type]
        node=node,
        driver="gpu.nvidia.com",
        claim_uid=uid,
        claim_namespace=namespace,
        claim_name=f"claim-{uid}",
        observed_at=at,
        event_id=claim_event_id(node, uid, 1, kind) if event_id is None else event_id,
        devices=[PreparedDeviceRef(request="gpu", pool=node, device=d) for d in devices],
    )


async def forge(bus: Bus, ev: ClaimLifecycle, *, namespace: str, node: str, msg_id: str | None = None) -> None:
    """Publish `ev` on the subject of (namespace, node), whatever its body says."""
    await bus.publish(catalog.CLAIM, ev, msg_id=msg_id or ev.event_id, namespace=namespace, node=node, event=ev.event)


async def real_claim_on_gpu_b(bus: Bus, uid: str) -> float:
    """gpu-b's preparer emits prepared then unprepared for `uid` (team-b, one GPU); the GPU-seconds due."""
    events = LifecycleEvents("gpu-b", "gpu.nvidia.com")
    await events.outbox.add(
        [
            events.make(
                "prepared",
                uid=uid,
                namespace="team-b",
                name=f"claim-{uid}",
                preparation=1,
                devices=[PreparedDeviceRef(request="gpu", pool="gpu-b", device="gpu-0")],
            ),
            events.make("unprepared", uid=uid, namespace="team-b", name=f"claim-{uid}", preparation=1),
        ]
    )
    prepared, unprepared = list(events.pending)
    assert prepared.event_id == f"gpu-b/{uid}/1/prepared"
    await send_all(events, bus)
    return unprepared.observed_at - prepared.observed_at


async def test_an_event_whose_body_names_another_namespace_or_node_is_not_accounted(
    shipped_nats: EmbeddedNats, ledger: LedgerService, dead_letters: DeadLetters, admin_bus: Bus
) -> None:
    received: list[ClaimLifecycle] = []

    async def on_claim(ev: ClaimLifecycle, _ctx: object) -> None:
        received.append(ev)

    # a driver-side consumer of claim events gets the same refusal from the bus
    await admin_bus.subscribe(catalog.CLAIM, on_claim)
    await admin_bus.nc.flush()
    now = now_unix()
    async with bus_as(shipped_nats, "preparer.gpu-a") as attacker:
        # on gpu-a's subject for team-a, a body billing team-b; on gpu-a's subject, a body naming gpu-b
        await forge(attacker, event("prepared", "x1", "team-b", "gpu-a", now - 100), namespace="team-a", node="gpu-a")
        await forge(attacker, event("unprepared", "x1", "team-b", "gpu-a", now), namespace="team-a", node="gpu-a")
        await forge(attacker, event("prepared", "x2", "team-b", "gpu-b", now - 100), namespace="team-b", node="gpu-a")
        await forge(attacker, event("unprepared", "x2", "team-b", "gpu-b", now), namespace="team-b", node="gpu-a")
        # an honest event of gpu-a's, so the ledger has something it does account
        await forge(attacker, event("prepared", "a1", "team-a", "gpu-a", now - 50), namespace="team-a", node="gpu-a")
    await ledger.wait_until(lambda lg: lg.stats.identity_mismatches + lg.stats.applied == 5)
    assert ledger.ledger.stats.identity_mismatches == 4
    assert "team-b" not in ledger.ledger.report(now=now)
    assert [u.claim for u in ledger.ledger.open.values()] == ["claim-a1"]
    await dead_letters.next(
        reason=REASON, subject=catalog.CLAIM.format(namespace="team-b", node="gpu-a", event="unprepared")
    )
    # the honest event went out last: once this consumer has it, every forged one before it was handled (refused)
    await eventually(lambda: received, "the honest event at the driver-side consumer")
    assert [ev.claim_uid for ev in received] == ["a1"]


async def test_a_forged_future_event_id_does_not_drop_the_real_event(
    shipped_nats: EmbeddedNats, ledger: LedgerService
) -> None:
    async with bus_as(shipped_nats, "preparer.gpu-a") as attacker, bus_as(shipped_nats, "preparer.gpu-b") as real:
        now = now_unix()
        for kind in ("prepared", "unprepared"):
            target = claim_event_id("gpu-b", "b1", 1, kind)
            # gpu-b's future id in the body (refused: not gpu-a's), and as the stream's message id
            await forge(
                attacker,
                event(kind, "b1", "team-b", "gpu-a", now, event_id=target),
                namespace="team-b",
                node="gpu-a",
                msg_id=target,
            )
            # the older id shape, which named no node, under gpu-a: it cannot collide with gpu-b's
            await forge(
                attacker,
                event(kind, "b1", "team-b", "gpu-a", now, event_id=f"b1/{kind}/1", devices=()),
                namespace="team-b",
                node="gpu-a",
                msg_id=f"b1/{kind}/1",
            )
        due = await real_claim_on_gpu_b(real, "b1")
    await ledger.wait_until(lambda lg: lg.report().get("team-b", {}).get("claims_closed", 0) >= 2)
    assert ledger.ledger.stats.identity_mismatches == 2
    assert ledger.ledger.stats.duplicates == 0
    assert ledger.ledger.report()["team-b"]["gpu_seconds"] == pytest.approx(due)


async def test_a_forged_timestamp_bills_at_most_the_bound(shipped_nats: EmbeddedNats, ledger: LedgerService) -> None:
    async with bus_as(shipped_nats, "preparer.gpu-a") as attacker:
        # identity consistent with gpu-a's subject; the times are not: 1.8e9 GPU-seconds claimed
        await forge(attacker, event("prepared", "t1", "team-a", "gpu-a", 0.0), namespace="team-a", node="gpu-a")
        await forge(attacker, event("unprepared", "t1", "team-a", "gpu-a", 1.8e9), namespace="team-a", node="gpu-a")
    await ledger.wait_until(lambda lg: lg.stats.applied == 2)
    billed = ledger.ledger.report()["team-a"]["gpu_seconds"]
    assert 0.0 <= billed <= trust.MAX_LAG_S + 60.0
    assert ledger.ledger.stats.clamped_times == 2
