"""The dashboard's utilisation rings (bounded: points per slot, window, bytes per device) and GPU-hours per
namespace (the shared billing rule, clipped to the last day), without a server."""

from __future__ import annotations

import tracemalloc

import pytest

from services.dashboard.gpuhours import GpuHours
from services.dashboard.utilisation import POINTS, WINDOW_S, TelemetryStore
from shared.events.claims import PreparedDeviceRef
from shared.events.telemetry import DeviceSample, NodeTelemetry
from tests.dashboard.claimevents import claim_use

T0 = 1_800_000_000.0


def sample(node: str, at: float, sm: int, gpus: int = 8) -> NodeTelemetry:
    return NodeTelemetry(
        node=node,
        interval_s=10.0,
        observed_at=at,
        devices=[
            DeviceSample(
                device=f"gpu-{i}",
                uuid=f"GPU-3f1c9a52-6d0e-5b8f-9a41-{node}-{i:04d}",
                sm_percent=sm,
                memory_used_bytes=sm << 28,
                memory_total_bytes=80 << 30,
                power_mw=100_000 + sm * 5000,
                temperature_c=30 + sm // 3,
            )
            for i in range(gpus)
        ],
    )


def test_a_ring_keeps_one_point_per_10_s_slot_for_10_minutes_whatever_the_rate() -> None:
    store = TelemetryStore()
    for k in range(2000):  # a node sampling every second for 33 minutes, at fractions of a second
        store.add(sample("n1", T0 + k + 0.25, k % 100, gpus=1))
    ring = store.nodes["n1"].devices["gpu-0"]
    assert len(ring.t) == POINTS == 61
    assert ring.t[-1] == T0 + 1999 and ring.t[0] == T0 + 1999 - WINDOW_S, "both ends of the window"
    assert all(int(b // 10) == int(a // 10) + 1 for a, b in zip(ring.t, ring.t[1:], strict=False))
    assert ring.sm[-1] == 1999 % 100, "the newest sample of a slot is its point"
    assert not store.add(sample("n1", T0, 5, gpus=1)), "an older message is dropped"


def test_a_message_replaces_the_nodes_devices_and_a_silent_node_is_forgotten() -> None:
    store = TelemetryStore()
    store.add(sample("n1", T0, 10, gpus=2))
    store.add(sample("n2", T0, 10, gpus=1))
    store.add(sample("n1", T0 + 10, 20, gpus=1))
    assert list(store.nodes["n1"].devices) == ["gpu-0"]
    store.add(sample("n1", T0 + WINDOW_S + 70, 20, gpus=1))
    assert "n2" not in store.nodes and store.node_view("n2") is None
    view = store.node_view("n1")
    assert view is not None and view["devices"]["gpu-0"]["ring"]["t"] == [T0 + WINDOW_S + 70], "older left the window"


def test_the_rings_of_1000_devices_hold_under_2_5_kb_each() -> None:
    messages = [[sample(f"node-{n:04d}", T0 + 10 * k, k % 100) for n in range(125)] for k in range(80)]
    tracemalloc.start()
    try:
        store = TelemetryStore()
        before = tracemalloc.get_traced_memory()[0]
        for batch in messages:
            for message in batch:
                store.add(message)
        per_device = (tracemalloc.get_traced_memory()[0] - before) / 1000
    finally:
        tracemalloc.stop()
    print(f"\nutilisation ring: {per_device:.0f} bytes per device ({POINTS} points)")
    assert len(store.nodes["node-0000"].devices["gpu-7"].t) == POINTS
    assert per_device < 1600


GPU = [PreparedDeviceRef(request="r", pool="n1", device="gpu-0")]
SHARE = [
    PreparedDeviceRef(
        request="r",
        pool="n1",
        device="gpu-1",
        share_id="s",
        consumed_capacity={"memory": "20Gi", "compute": "50"},
        capacity={"memory": "80Gi"},
    )
]
MIG = [PreparedDeviceRef(request="r", pool="n1", device="gpu-2-mig-1g10gb-19-0")]


def test_gpu_hours_clip_each_use_to_the_last_day_and_bill_shares_by_memory() -> None:
    hours = GpuHours()
    now = T0 + 30 * 3600
    for event in (
        claim_use("prepared", "a", T0, GPU),  # 30 h ago, still open: 24 h in the window
        claim_use("prepared", "b", now - 4 * 3600, SHARE),  # 20Gi of 80Gi for 4 h: 1 GPU-hour (memory, not compute)
        claim_use("prepared", "b", now - 3 * 3600, SHARE),  # a repeat keeps the start
        claim_use("unprepared", "b", now, SHARE),
        claim_use("prepared", "c", now - 2 * 3600, MIG, ns="team-b"),
        claim_use("rolled-back", "c", now - 3600, MIG, ns="team-b"),
        claim_use("unprepared", "never-seen", now, GPU, ns="team-c"),  # a close without its prepare counts nothing
    ):
        hours.apply(event)
    report = {r.namespace: r for r in hours.report(now)}
    assert set(report) == {"team-a", "team-b"}
    assert report["team-a"].gpu_hours == pytest.approx(24 + 1)
    assert report["team-a"].claims_open == 1
    assert report["team-b"].mig_hours == {"1g10gb": pytest.approx(1.0)} and report["team-b"].gpu_hours == 0
    # a day later the closed uses have left the window and are dropped
    hours.apply(claim_use("prepared", "d", now + 25 * 3600, GPU))
    assert set(hours.uses) == {"a@n1", "d@n1"}


def test_closed_uses_leave_the_window_by_their_end_in_whatever_order_their_events_came() -> None:
    hours = GpuHours()
    for event in (
        claim_use("prepared", "late", T0, GPU),
        claim_use("prepared", "early", T0, GPU, node="n2"),
        claim_use("unprepared", "late", T0 + 2 * 3600, GPU),  # seen first, though it ended last
        claim_use("unprepared", "early", T0 + 3600, GPU, node="n2"),
        claim_use("prepared", "late", T0 + 3 * 3600, GPU),  # prepared again: a use of its own, open
        claim_use("unprepared", "never-seen", T0 + 3 * 3600, GPU),  # a close without its prepare keeps nothing
    ):
        hours.apply(event)
    assert set(hours.uses) == {"late@n1", "early@n2"}
    hours.apply(claim_use("prepared", "x", T0 + 25.5 * 3600, GPU))  # the window now starts at T0 + 1.5 h
    assert set(hours.uses) == {"late@n1", "x@n1"} and len(hours.uses["late@n1"]) == 2
    hours.apply(claim_use("prepared", "y", T0 + 26.5 * 3600, GPU))  # ... at T0 + 2.5 h
    assert [u.end for u in hours.uses["late@n1"]] == [None], "the open use stays, the closed one left"
    report = {r.namespace: r for r in hours.report(T0 + 27 * 3600)}
    assert report["team-a"].gpu_hours == pytest.approx(24 + 1.5 + 0.5)  # late's open use, x, y
    assert report["team-a"].claims_open == 3


def test_a_claim_prepared_again_after_its_unprepare_bills_both_uses() -> None:
    hours = GpuHours()
    now = T0 + 10 * 3600
    for event in (
        claim_use("prepared", "a", now - 5 * 3600, GPU),
        claim_use("unprepared", "a", now - 4 * 3600, GPU),  # 1 h
        claim_use("prepared", "a", now - 2 * 3600, GPU),  # the same claim on the same node again: 2 h so far
    ):
        hours.apply(event)
    (report,) = hours.report(now)
    assert report.gpu_hours == pytest.approx(3.0) and report.claims_open == 1
    hours.apply(claim_use("unprepared", "a", now - 3600, GPU))
    (report,) = hours.report(now)
    assert report.gpu_hours == pytest.approx(2.0) and report.claims_open == 0
