"""GPU-hours across dashboard restarts, against a real nats-server on the shipped configuration with the dashboard
connected as `reader.dashboard`: a dashboard started after claims were prepared and unprepared replays them from
DRA_EVENTS, and what is published once it runs is counted once (one ordered consumer for the past and the live);
a second dashboard reports the same day; a consumer lost on the server is made again without a gap or a double.
Each step awaits the events the dashboard applied, in the order it applied them, up to a last one published after
the others: a double or a gap before it would show in that list."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from services.dashboard.gpuhours import GpuHours
from services.dashboard.state import FleetState
from shared import jetstream
from shared.bus import Bus
from shared.events import catalog
from shared.events.claims import ClaimLifecycle, PreparedDeviceRef
from shared.natsserver import EmbeddedNats
from tests.security.conftest import bus_as, shipped_nats  # noqa: F401 - the shipped server, provisioned

WAIT_S = 10.0
H = 3600.0
_ids = itertools.count()


class Applied(GpuHours):
    """GpuHours that hands each event it applies to the test, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: asyncio.Queue[str] = asyncio.Queue()

    def apply(self, event: ClaimLifecycle) -> None:
        super().apply(event)
        self.seen.put_nowait(event.event_id)

    async def until(self, last: str) -> list[str]:
        """The events applied from now up to and including `last`."""
        out: list[str] = []
        async with asyncio.timeout(WAIT_S):
            while not out or out[-1] != last:
                out.append(await self.seen.get())
        return out


def use(kind: str, uid: str, at: float, device: str = "gpu-0", ns: str = "team-a") -> ClaimLifecycle:
    return ClaimLifecycle(
        event_id=f"gpu-a/{uid}/{kind}/{next(_ids)}",
        event=kind,  # type: ignore[arg-type]
        node="gpu-a",
        driver="gpu.nvidia.com",
        claim_uid=uid,
        claim_namespace=ns,
        claim_name=uid,
        devices=[PreparedDeviceRef(request="r", pool="gpu-a", device=device)],
        observed_at=at,
    )


async def publish(preparer: Bus, *events: ClaimLifecycle) -> list[str]:
    for event in events:
        await preparer.publish(
            catalog.CLAIM,
            event,
            msg_id=event.event_id,
            namespace=event.claim_namespace,
            node=event.node,
            event=event.event,
        )
    return [event.event_id for event in events]


async def dashboard(bus: Bus) -> tuple[FleetState, Applied]:
    state = FleetState(None)
    state.listed = True  # as once the informers listed: live events go to the devices' histories
    state.gpu_hours = hours = Applied()
    await state.subscribe_bus(bus)
    return state, hours


def hours_of(state: FleetState, now: float) -> dict[str, tuple[float, int]]:
    return {r.namespace: (round(r.gpu_hours, 6), r.claims_open) for r in state.gpu_hours.report(now)}


def kinds(state: FleetState, device: str) -> list[str]:
    return [e.type for e in state.events("gpu-a", device)]


async def test_a_dashboard_started_after_claims_counts_their_hours_and_a_live_claim_once(
    shipped_nats: EmbeddedNats,  # noqa: F811
) -> None:
    now = time.time()
    async with bus_as(shipped_nats, "preparer.gpu-a") as preparer:
        past = await publish(
            preparer,
            use("prepared", "a", now - 3 * H),
            use("unprepared", "a", now - 2 * H),  # 1 GPU-hour, closed before the dashboard started
            use("prepared", "b", now - 5 * H),  # still held when it starts
        )
        async with bus_as(shipped_nats, "reader.dashboard") as bus:
            state, hours = await dashboard(bus)
            assert await hours.until(past[-1]) == past
            assert hours_of(state, now) == {"team-a": (1 + 5, 1)}
            live = await publish(
                preparer,
                use("unprepared", "b", now - 1 * H),
                use("prepared", "c", now - 0.5 * H, device="gpu-1", ns="team-b"),
            )
            assert await hours.until(live[-1]) == live, "each live event once, none of the past again"
            assert hours_of(state, now) == {"team-a": (1 + 4, 0), "team-b": (0.5, 1)}
            # the past counts in GPU-hours only; the devices' histories start with the live events
            assert kinds(state, "gpu-0") == ["unprepared"] and kinds(state, "gpu-1") == ["prepared"]


async def test_a_restarted_dashboard_keeps_the_days_figures(shipped_nats: EmbeddedNats) -> None:  # noqa: F811
    now = time.time()
    async with bus_as(shipped_nats, "preparer.gpu-a") as preparer:
        sent = await publish(preparer, use("prepared", "a", now - 20 * H), use("prepared", "m", now - 6 * H, "gpu-1"))
        async with bus_as(shipped_nats, "reader.dashboard") as bus:
            first, hours = await dashboard(bus)
            assert await hours.until(sent[-1]) == sent
            sent += await publish(preparer, use("unprepared", "a", now - 2 * H), use("prepared", "x", now - H, ns="b"))
            await hours.until(sent[-1])
            before = hours_of(first, now)
        assert before == {"team-a": (18 + 6, 1), "b": (1, 1)}
        async with bus_as(shipped_nats, "reader.dashboard") as bus:
            second, hours = await dashboard(bus)
            assert await hours.until(sent[-1]) == sent, "the whole day replayed, each event once"
            assert hours_of(second, now) == before
            assert kinds(second, "gpu-0") == kinds(second, "gpu-1") == []


async def test_a_lost_consumer_is_made_again_from_the_next_event(
    shipped_nats: EmbeddedNats,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server loses the dashboard's consumer (deleted by the admin here; a restart or a long disconnect in
    life): two missed heartbeats later nats-py makes it again from the stream sequence after the last it
    delivered, so what was published meanwhile comes once and nothing before it again."""
    monkeypatch.setattr(jetstream, "ORDERED_HEARTBEAT_S", 0.2)
    now = time.time()
    stream = catalog.EVENTS_STREAM.name
    async with (
        bus_as(shipped_nats, "preparer.gpu-a") as preparer,
        bus_as(shipped_nats, "admin") as admin,
        bus_as(shipped_nats, "reader.dashboard") as bus,
    ):
        state, hours = await dashboard(bus)
        first = await publish(preparer, use("prepared", "a", now - 2 * H))
        assert await hours.until(first[-1]) == first
        ours = [
            c.name
            for c in await admin.js.consumers_info(stream)
            if "reader_dashboard" in (c.config.deliver_subject or "")
        ]
        assert len(ours) == 1
        await admin.js.delete_consumer(stream, ours[0])
        meanwhile = await publish(preparer, use("unprepared", "a", now - H), use("prepared", "b", now - H))
        assert await hours.until(meanwhile[-1]) == meanwhile
        assert hours_of(state, now) == {"team-a": (1 + 1, 1)}
        remade = [
            c for c in await admin.js.consumers_info(stream) if "reader_dashboard" in (c.config.deliver_subject or "")
        ]
        assert [c.name for c in remade] != ours and len(remade) == 1
