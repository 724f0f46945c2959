"""The fleet page's claim -> trace map holds the claims that exist: a deleted claim's entry goes, and the end of a
use reported after its claim's deletion does not bring it back (a long-running dashboard's memory stays bounded)."""

from __future__ import annotations

from services.dashboard.state import FleetState
from shared.bus import MsgContext
from shared.events.claims import PreparedDeviceRef
from tests.dashboard.claimevents import claim_use

UID = "0f6c1d8e-5a4b-4c3d-9e2f-1a2b3c4d5e6f"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
GPU = [PreparedDeviceRef(request="r", pool="n1", device="gpu-0")]
CLAIM = {"metadata": {"namespace": "team-a", "name": UID, "uid": UID}, "spec": {}, "status": {}}


def context() -> MsgContext:
    return MsgContext(subject="dra.v1.claim.team-a.n1.x", headers={"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"})


async def test_a_deleted_claims_trace_is_dropped_and_a_late_unprepare_does_not_bring_it_back() -> None:
    state = FleetState(None)
    state.listed = True
    state._on_claim("ADDED", CLAIM, None)
    await state._on_claim_event(claim_use("prepared", UID, 1.8e9, GPU), context())
    assert state.claim_trace_id(CLAIM) == TRACE
    await state._on_claim_event(claim_use("unprepared", UID, 1.8e9 + 60, GPU), context())
    assert state.claim_trace_id(CLAIM) == TRACE, "an unprepared claim that still exists keeps its trace"
    state._on_claim("DELETED", CLAIM, CLAIM)
    assert state.traces == {}
    await state._on_claim_event(claim_use("rolled-back", UID, 1.8e9 + 61, GPU), context())  # late, after the delete
    assert state.traces == {} and state.claim_trace_id(CLAIM) == ""
