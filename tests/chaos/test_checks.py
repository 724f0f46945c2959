"""The chaos run's checks find what they look for (so a clean run means something)."""

from __future__ import annotations

from bench.chaos_checks import check_events, doubles_in_allocations, doubles_in_checkpoint
from bench.chaos_churn import Run


def ev(node: str, uid: str, prep: int, event: str) -> dict:
    return {"event_id": f"{node}/{uid}/{prep}/{event}", "event": event, "node": node, "claim_uid": uid}


def test_events_duplicate_and_lost_are_found() -> None:
    run = Run(pods=3, seed=1, nodes=["n"])
    run.claim_of = {"p1": ("u1", "n"), "p2": ("u2", "n"), "p3": ("u3", "n")}
    events = [
        ev("n", "u1", 1, "prepare-started"),
        ev("n", "u1", 1, "prepared"),
        ev("n", "u1", 1, "unprepared"),
        ev("n", "u1", 1, "unprepared"),  # doubled
        ev("n", "u2", 2, "prepare-started"),
        ev("n", "u2", 2, "prepared"),  # never closed
        ev("n", "u3", 3, "prepare-failed"),  # a failed call of its own: complete; but p3 ran unprepared
        ev("n", "u4", 4, "prepare-started"),
        ev("n", "u4", 4, "rolled-back"),
        ev("n", "u4", 4, "prepare-failed"),
    ]
    out = check_events(events, run)
    assert out["duplicate_ids"] == ["n/u1/1/unprepared"]
    assert out["incomplete_preparations"] == ["n/u2/2: ['prepare-started', 'prepared']"]
    assert out["ran_without_prepared_event"] == ["p3 u3@n"]
    assert out["preparations"] == 4

    run.claim_of = {"p1": ("u1", "n")}
    clean = check_events([*events[:3], *events[7:]], run)
    assert clean["duplicate_ids"] == clean["incomplete_preparations"] == clean["ran_without_prepared_event"] == []
    no_start = check_events(events[1:3], run)  # a prepared/unprepared whose prepare-started is missing
    assert no_start["incomplete_preparations"] == ["n/u1/1: ['prepared', 'unprepared']"]


def test_a_device_held_twice_is_found_unless_every_holder_shares_it() -> None:
    def entry(device: str, shared: bool = False) -> dict:
        return {"devices": [{"pool": "n", "device": device, "shared": shared}]}

    assert doubles_in_checkpoint({"a": entry("gpu-0"), "b": entry("gpu-0"), "c": entry("gpu-1")}) == [
        "n/gpu-0: ['a', 'b']"
    ]
    assert doubles_in_checkpoint({"a": entry("gpu-0", True), "b": entry("gpu-0", True)}) == []

    def claim(uid: str, device: str) -> dict:
        return {
            "metadata": {"uid": uid},
            "status": {"allocation": {"devices": {"results": [{"pool": "n", "device": device}]}}},
        }

    assert doubles_in_allocations([claim("a", "gpu-0"), claim("b", "gpu-0"), claim("c", "gpu-1")]) == [
        "n/gpu-0: ['a', 'b']"
    ]
    assert doubles_in_allocations([claim("a", "gpu-0"), claim("c", "gpu-1")]) == []
