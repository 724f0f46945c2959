"""ClusterState's assumed claim writes: devices count as taken from the decision until the answer, and a
lagging watch or re-list never drops them; a failed write puts the claim back."""

from __future__ import annotations

import copy
from typing import Any

from embedded.scheduler.state import ClusterState
from shared.kube.resources import RESOURCECLAIMS

DEVICE = ("gpu.nvidia.com", "node-0", "gpu-0")


def claim(rv: int, allocated: bool = False) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"namespace": "default", "name": "c", "uid": "u1", "resourceVersion": str(rv)},
        "spec": {},
    }
    if allocated:
        obj["status"] = {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": DEVICE[0], "pool": DEVICE[1], "device": DEVICE[2]}]
                }
            }
        }
    return obj


def assumed_state() -> tuple[ClusterState, dict[str, Any]]:
    state = ClusterState()
    original = claim(5)
    state.replace_all(RESOURCECLAIMS, [original])
    state.assume(claim(5, allocated=True))  # built from version 5, not written yet
    assert DEVICE in state.allocated.devices
    return state, original


def test_an_event_or_relist_of_the_version_it_is_based_on_keeps_the_assumption() -> None:
    state, original = assumed_state()
    state.apply(RESOURCECLAIMS, "ADDED", copy.deepcopy(original))  # the create's event, lagging behind
    assert DEVICE in state.allocated.devices
    state.replace_all(RESOURCECLAIMS, [copy.deepcopy(original)])  # a re-list served before the write landed
    assert DEVICE in state.allocated.devices
    cached = state.get(RESOURCECLAIMS, "default", "c")
    assert cached is not None and cached["status"]["allocation"]


def test_the_answer_or_a_newer_version_replaces_it() -> None:
    state, _ = assumed_state()
    state.apply(RESOURCECLAIMS, "MODIFIED", claim(6, allocated=True))  # the write's answer
    assert not state.assumed and DEVICE in state.allocated.devices
    state.apply(RESOURCECLAIMS, "MODIFIED", claim(7))  # deallocated later: an ordinary event again
    assert DEVICE not in state.allocated.devices

    state, _ = assumed_state()
    state.replace_all(RESOURCECLAIMS, [claim(6)])  # someone else changed it first: the write will conflict
    assert not state.assumed and DEVICE not in state.allocated.devices


def test_a_failed_write_puts_the_claim_back() -> None:
    state, original = assumed_state()
    state.forget(original)
    assert not state.assumed and DEVICE not in state.allocated.devices
    assert state.get(RESOURCECLAIMS, "default", "c") is original
    state, original = assumed_state()
    state.apply(RESOURCECLAIMS, "DELETED", claim(6))
    state.forget(original)  # replaced meanwhile (here: deleted): nothing to put back
    assert state.get(RESOURCECLAIMS, "default", "c") is None and DEVICE not in state.allocated.devices
