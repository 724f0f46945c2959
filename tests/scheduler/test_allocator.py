"""The allocator against simulated nodes' real slices: semantics of §5 and the explanations it gives."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest

from embedded.scheduler.allocator import AllocatedState, schedule
from embedded.scheduler.pools import SliceIndex
from embedded.scheduler.simslices import node_slices
from tests.scheduler.conftest import claim, exactly

GPU = "gpu.nvidia.com"


def devices_of(outcome: Any, key: str) -> list[str]:
    return [r["device"] for r in outcome.allocations[key]["devices"]["results"]]


def uuid_of(slices: list[dict[str, Any]], device: str) -> str:
    for s in slices:
        for d in s["spec"].get("devices") or []:
            if d["name"] == device:
                return str(d["attributes"]["uuid"]["string"])
    raise AssertionError(device)


def commit(state: AllocatedState, c: dict[str, Any], outcome: Any) -> dict[str, Any]:
    done = copy.deepcopy(c)
    done["status"] = {"allocation": outcome.allocations[f"{c['metadata']['namespace']}/{c['metadata']['name']}"]}
    state.add_claim(done)
    return done


def test_allocation_has_the_v1_status_shape(h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]) -> None:
    c = claim("one", [exactly("gpu")])
    out = schedule([c], classes, h100_slices, AllocatedState(), ["h100-node"])
    assert out.node == "h100-node"
    assert out.allocations["default/one"] == {
        "devices": {
            "results": [{"request": "gpu", "driver": GPU, "pool": "h100-node", "device": "gpu-0"}],
            "config": [],
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["h100-node"]}]}
            ]
        },
    }


def test_count_takes_distinct_devices_and_explains_shortfall(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    out = schedule([claim("two", [exactly("gpu", count=2)])], classes, h100_slices, AllocatedState(), ["h100-node"])
    assert devices_of(out, "default/two") == ["gpu-0", "gpu-1"]
    state = AllocatedState({(GPU, "h100-node", f"gpu-{i}"): "other/claim" for i in range(6)})
    out = schedule([claim("three", [exactly("gpu", count=3)])], classes, h100_slices, state, ["h100-node"])
    assert out.node is None
    report = out.reports[0].requests[0]
    assert report.eligible == 2 and report.wanted == "3"
    taken = next(r for r in report.rejections if r.reason.startswith("already allocated"))
    assert taken.count == 6 and taken.reason == "already allocated to claim other/claim"


def test_all_mode_takes_every_matching_device_or_none(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    c = claim("all", [exactly("gpu", allocationMode="All")])
    out = schedule([c], classes, h100_slices, AllocatedState(), ["h100-node"])
    assert devices_of(out, "default/all") == [f"gpu-{i}" for i in range(8)]
    busy = AllocatedState({(GPU, "h100-node", "gpu-3"): "ns/holder"})
    out = schedule([c], classes, h100_slices, busy, ["h100-node"])
    assert out.node is None
    assert "allocationMode All needs every matching device" in out.reports[0].requests[0].error


def test_backtracking_moves_an_earlier_request(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    uuid0 = uuid_of(h100_slices, "gpu-0")
    c = claim("bt", [exactly("any"), exactly("first", GPU, f"device.attributes['gpu.nvidia.com'].uuid == '{uuid0}'")])
    out = schedule([c], classes, h100_slices, AllocatedState(), ["h100-node"])
    assert devices_of(out, "default/bt") == ["gpu-1", "gpu-0"]


def test_first_available_prefers_the_first_subrequest_that_fits(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    fa: dict[str, Any] = {
        "name": "gpu",
        "firstAvailable": [
            {
                "name": "big",
                "deviceClassName": GPU,
                "selectors": [
                    {
                        "cel": {
                            "expression": "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('141Gi')) >= 0"
                        }
                    }
                ],
            },
            {"name": "two", "deviceClassName": GPU, "count": 2},
        ],
    }
    out = schedule([claim("fa", [fa])], classes, h100_slices, AllocatedState(), ["h100-node"])
    results = out.allocations["default/fa"]["devices"]["results"]
    assert [r["request"] for r in results] == ["gpu/two", "gpu/two"]
    fa["firstAvailable"][0]["selectors"][0]["cel"]["expression"] = (
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"
    )
    out = schedule([claim("fa", [fa])], classes, h100_slices, AllocatedState(), ["h100-node"])
    assert [r["request"] for r in out.allocations["default/fa"]["devices"]["results"]] == ["gpu/big"]


def test_first_available_subrequest_chosen_so_the_rest_fits(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    # "wide" (7 GPUs) fits alone but leaves too few for the second request; the search falls back to "one".
    fa = {
        "name": "a",
        "firstAvailable": [
            {"name": "wide", "deviceClassName": GPU, "count": 7},
            {"name": "one", "deviceClassName": GPU},
        ],
    }
    c = claim("fa2", [fa, exactly("b", count=2)])
    out = schedule([c], classes, h100_slices, AllocatedState(), ["h100-node"])
    assert [r["request"] for r in out.allocations["default/fa2"]["devices"]["results"]] == ["a/one", "b", "b"]


def test_taints_block_unless_tolerated_and_tolerations_are_copied(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    slices = copy.deepcopy(h100_slices)
    for d in slices[0]["spec"]["devices"]:
        d["taints"] = [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]
    slices[0]["spec"]["devices"][7]["taints"] = [{"key": "info", "value": "", "effect": "None"}]
    out = schedule([claim("t", [exactly("gpu", count=2)])], classes, slices, AllocatedState(), ["h100-node"])
    assert out.node is None
    rej = out.reports[0].requests[0].rejections[0]
    assert rej.reason == "taint gpu.nvidia.com/xid=79:NoSchedule not tolerated" and rej.count == 7
    tol = [{"key": "gpu.nvidia.com/xid", "operator": "Exists", "effect": "NoSchedule"}]
    out = schedule(
        [claim("t", [exactly("gpu", count=2, tolerations=tol)])], classes, slices, AllocatedState(), ["h100-node"]
    )
    results = out.allocations["default/t"]["devices"]["results"]
    assert [r["device"] for r in results] == ["gpu-0", "gpu-1"]
    assert results[0]["tolerations"] == tol
    wrong = [{"key": "gpu.nvidia.com/xid", "operator": "Equal", "value": "48"}]
    out = schedule(
        [claim("t", [exactly("gpu", count=2, tolerations=wrong)])], classes, slices, AllocatedState(), ["h100-node"]
    )
    assert out.node is None


def test_admin_access_needs_the_namespace_label_and_ignores_allocations(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    busy = AllocatedState({(GPU, "h100-node", f"gpu-{i}"): "ns/holder" for i in range(8)})
    c = claim("admin", [exactly("gpu", adminAccess=True)], namespace="monitoring")
    out = schedule([c], classes, h100_slices, busy, ["h100-node"])
    assert out.node is None and out.reports == []
    assert "resource.kubernetes.io/admin-access=true" in out.problems[0].message
    out = schedule([c], classes, h100_slices, busy, ["h100-node"], admin_namespaces={"monitoring"})
    assert out.allocations["monitoring/admin"]["devices"]["results"][0]["adminAccess"] is True
    # Admin results never count as allocated.
    done = commit(AllocatedState(), c, out)
    assert AllocatedState.from_claims([done]).devices == {}


def test_generations_and_incomplete_pools(h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]) -> None:
    old = copy.deepcopy(h100_slices[0])
    old["metadata"]["name"] = "stale"
    old["spec"]["pool"]["generation"] = 0
    old["spec"]["devices"] = [dict(old["spec"]["devices"][0], name="ghost")]
    out = schedule(
        [claim("c", [exactly("g", allocationMode="All")])],
        classes,
        [old, *h100_slices],
        AllocatedState(),
        ["h100-node"],
    )
    assert "ghost" not in devices_of(out, "default/c")
    incomplete = copy.deepcopy(h100_slices)
    incomplete[0]["spec"]["pool"]["resourceSliceCount"] = 2
    out = schedule([claim("c", [exactly("g")])], classes, incomplete, AllocatedState(), ["h100-node"])
    assert out.node is None
    assert "incomplete: 1 of 2 slices" in out.reports[0].notes[0]


def test_nothing_published_for_a_node(h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]) -> None:
    out = schedule([claim("c", [exactly("g")])], classes, h100_slices, AllocatedState(), ["elsewhere", "h100-node"])
    assert out.node == "h100-node"
    assert out.reports[0].problem == "no ResourceSlices are published for this node"


def test_configs_from_class_and_claim(h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]) -> None:
    cls = copy.deepcopy(classes)
    opaque = {"driver": GPU, "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}}
    cls[0]["spec"]["config"] = [{"opaque": opaque}]
    mine = {"driver": GPU, "parameters": {"kind": "GpuConfig", "sharing": {"strategy": "MPS"}}}
    c = claim(
        "cfg",
        [exactly("a"), exactly("b")],
        config=[{"requests": ["b"], "opaque": mine}, {"requests": ["a", "b"], "opaque": mine}],
    )
    out = schedule([c], cls, h100_slices, AllocatedState(), ["h100-node"])
    assert out.allocations["default/cfg"]["devices"]["config"] == [
        {"source": "FromClass", "opaque": opaque},
        {"source": "FromClaim", "requests": ["b"], "opaque": mine},
        {"source": "FromClaim", "opaque": mine},
    ]


@pytest.mark.parametrize(
    ("mutation", "expected"),
    [
        ({"deviceClassName": "nope"}, "DeviceClass 'nope' does not exist"),
        ({"allocationMode": "Some"}, "allocationMode 'Some' is unknown"),
        ({"count": 0}, "count must be at least 1"),
        (
            {"selectors": [{"cel": {"expression": "device.driver =="}}]},
            "selector #1 does not compile: CEL syntax error",
        ),
    ],
)
def test_bad_claims_are_explained(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]], mutation: dict[str, Any], expected: str
) -> None:
    request = exactly("gpu")
    request["exactly"].update(mutation)
    out = schedule([claim("bad", [request])], classes, h100_slices, AllocatedState(), ["h100-node"])
    assert out.node is None and out.allocations == {}
    assert expected in out.problems[0].message and out.problems[0].claim == "default/bad"


def test_selector_runtime_error_fails_the_request_with_the_reason(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    c = claim("err", [exactly("gpu", GPU, "device.attributes['gpu.nvidia.com'].index == 0")])
    out = schedule([c], classes, h100_slices, AllocatedState(), ["h100-node"])
    assert out.node is None
    assert out.reports[0].requests[0].error.endswith("failed on device gpu-0: no such key: index")


def test_two_pods_get_distinct_devices_through_allocated_state(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    state = AllocatedState()
    seen = []
    for i in range(8):
        c = claim(f"c{i}", [exactly("gpu")])
        out = schedule([c], classes, h100_slices, state, ["h100-node"])
        seen += devices_of(out, f"default/c{i}")
        commit(state, c, out)
    assert sorted(seen) == sorted(f"gpu-{i}" for i in range(8))
    out = schedule([claim("c9", [exactly("gpu")])], classes, h100_slices, state, ["h100-node"])
    assert out.node is None


def test_node_selector_slices_and_labels(h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]) -> None:
    shared = copy.deepcopy(h100_slices[0])
    shared["metadata"]["name"] = "rack-pool"
    del shared["spec"]["nodeName"]
    shared["spec"]["pool"]["name"] = "rack-a"
    selector = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "rack", "operator": "In", "values": ["a"]}]}]}
    shared["spec"]["nodeSelector"] = selector
    nodes = [
        {"metadata": {"name": "n-b", "labels": {"rack": "b"}}},
        {"metadata": {"name": "n-a", "labels": {"rack": "a"}}},
    ]
    out = schedule([claim("c", [exactly("g")])], classes, [shared], AllocatedState(), nodes)
    assert out.node == "n-a"
    assert out.allocations["default/c"]["nodeSelector"] == {"nodeSelectorTerms": [selector["nodeSelectorTerms"][0]]}


@pytest.mark.parametrize("minor", [34, 35])
def test_counters_keep_a_full_gpu_and_its_mig_devices_apart(
    h100_inv: Any, classes: list[dict[str, Any]], minor: int
) -> None:
    slices = node_slices(h100_inv, mig_mode="dynamic", minor=minor)
    layouts = [bool(s["spec"].get("devices")) and bool(s["spec"].get("sharedCounters")) for s in slices]
    assert any(layouts) == (minor == 34)  # 1.34 counters beside devices, 1.35 counters-only slice
    uuid0 = uuid_of(slices, "gpu-0")
    on_gpu0 = f"device.attributes['gpu.nvidia.com'].parentUUID == '{uuid0}'"
    full = claim("full", [exactly("gpu", GPU, f"device.attributes['gpu.nvidia.com'].uuid == '{uuid0}'")])
    mig = claim("mig", [exactly("mig", "mig.nvidia.com", on_gpu0)])
    state = AllocatedState()
    out = schedule([full], classes, slices, state, ["h100-node"])
    assert devices_of(out, "default/full") == ["gpu-0"]
    commit(state, full, out)
    out = schedule([mig], classes, slices, state, ["h100-node"])
    assert out.node is None
    reasons = [r.reason for r in out.reports[0].requests[0].rejections]
    assert any(r.startswith("counters used up by allocated devices (gpu-0-counter-set") for r in reasons)
    # ...and the other way round: a MIG device first keeps the full GPU away.
    state = AllocatedState()
    out = schedule([mig], classes, slices, state, ["h100-node"])
    assert devices_of(out, "default/mig")[0].startswith("gpu-0-mig-")
    commit(state, mig, out)
    out = schedule([full], classes, slices, state, ["h100-node"])
    assert out.node is None
    # ...and inside one claim: both at once are impossible.
    both = claim("both", [full["spec"]["devices"]["requests"][0], mig["spec"]["devices"]["requests"][0]])
    out = schedule([both], classes, slices, AllocatedState(), ["h100-node"])
    assert out.node is None
    conflicts = [c.reason for r in out.reports[0].requests for c in r.conflicts]
    assert any(c.startswith("counters taken by this pod's other devices") for c in conflicts)


def test_mig_placements_fill_a_gpu_then_spill(h100_inv: Any, classes: list[dict[str, Any]]) -> None:
    slices = node_slices(h100_inv, mig_mode="dynamic", minor=35)
    c = claim(
        "m", [exactly("m", "mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'", count=8)]
    )
    out = schedule([c], classes, slices, AllocatedState(), ["h100-node"])
    picked = devices_of(out, "default/m")
    assert len(set(picked)) == 8
    assert sum(1 for p in picked if p.startswith("gpu-0-")) == 7 and picked[-1].startswith("gpu-1-")


def test_match_attribute_failure_is_named(h100_inv: Any, classes: list[dict[str, Any]]) -> None:
    slices = node_slices(h100_inv, mig_mode="dynamic", minor=35)
    u0, u1 = uuid_of(slices, "gpu-0"), uuid_of(slices, "gpu-1")
    sel = "device.attributes['gpu.nvidia.com'].parentUUID == '{}'"
    c = claim(
        "ma",
        [exactly("a", "mig.nvidia.com", sel.format(u0)), exactly("b", "mig.nvidia.com", sel.format(u1))],
        constraints=[{"requests": [], "matchAttribute": "gpu.nvidia.com/parentUUID"}],
    )
    out = schedule([c], classes, slices, AllocatedState(), ["h100-node"])
    assert out.node is None
    b = out.reports[0].requests[1]
    assert b.eligible > 0
    assert b.conflicts[0].reason == "matchAttribute gpu.nvidia.com/parentUUID differs from the devices already chosen"
    # Scoped to one request only, the same claim fits.
    c["spec"]["devices"]["constraints"][0]["requests"] = ["a"]
    out = schedule([c], classes, slices, AllocatedState(), ["h100-node"])
    assert out.node == "h100-node"


def test_pod_claims_are_allocated_together(h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]) -> None:
    claims: list[Mapping[str, Any]] = [claim(f"p{i}", [exactly("gpu", count=3)]) for i in range(3)]
    out = schedule(claims, classes, h100_slices, AllocatedState(), ["h100-node"])
    assert out.node is None  # 9 GPUs wanted, 8 exist
    out = schedule(claims[:2], classes, h100_slices, AllocatedState(), ["h100-node"])
    assert set(devices_of(out, "default/p0")).isdisjoint(devices_of(out, "default/p1"))


def test_search_budget_is_bounded(h100_inv: Any, classes: list[dict[str, Any]]) -> None:
    slices = node_slices(h100_inv, mig_mode="dynamic", minor=35)
    # 1g.10gb on 8 GPUs: 56 candidates, but each of 9 devices needs its own GPU (matchAttribute on uuid-less
    # `profile` is fine, parentUUID forces one GPU): an impossible combination explored within the budget.
    c = claim(
        "big",
        [exactly("m", "mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'", count=8)],
        constraints=[{"matchAttribute": "gpu.nvidia.com/parentUUID"}],
    )
    out = schedule([c], classes, slices, AllocatedState(), ["h100-node"], budget=2000)
    assert out.node is None
    assert out.reports[0].problem == "the search gave up after 2000 device tries"


def test_one_index_serves_many_cycles(
    h100_inv: Any, h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    """What a node sees is kept on the index between cycles: counters are netted per call (never in
    the kept pools), and a node's labels are part of what it sees."""
    slices = node_slices(h100_inv, mig_mode="dynamic", minor=35)
    index = SliceIndex(slices)
    uuid0 = uuid_of(slices, "gpu-0")
    full = claim("full", [exactly("gpu", GPU, f"device.attributes['gpu.nvidia.com'].uuid == '{uuid0}'")])
    mig = claim(
        "mig", [exactly("mig", "mig.nvidia.com", f"device.attributes['gpu.nvidia.com'].parentUUID == '{uuid0}'")]
    )
    state = AllocatedState()
    held = commit(state, mig, schedule([mig], classes, index, state, ["h100-node"]))
    out = schedule([full], classes, index, state, ["h100-node"])
    assert out.node is None
    assert any(r.reason.startswith("counters used up") for r in out.reports[0].requests[0].rejections)
    state.remove_claim(held)
    assert devices_of(schedule([full], classes, index, state, ["h100-node"]), "default/full") == ["gpu-0"]

    shared = copy.deepcopy(h100_slices[0])
    shared["metadata"]["name"] = "rack-pool"
    del shared["spec"]["nodeName"]
    shared["spec"]["pool"]["name"] = "rack-a"
    shared["spec"]["nodeSelector"] = {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "rack", "operator": "In", "values": ["a"]}]}]
    }
    index = SliceIndex([shared])
    one = claim("c", [exactly("g")])
    assert schedule(
        [one], classes, index, AllocatedState(), [{"metadata": {"name": "n", "labels": {"rack": "a"}}}]
    ).node
    moved = schedule([one], classes, index, AllocatedState(), [{"metadata": {"name": "n", "labels": {"rack": "b"}}}])
    assert moved.node is None and moved.reports[0].problem == "no ResourceSlices are published for this node"


def test_requests_with_other_selectors_get_their_own_verdicts(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    index = SliceIndex(h100_slices)
    uuid3 = uuid_of(h100_slices, "gpu-3")
    this = claim("this", [exactly("gpu", GPU, f"device.attributes['gpu.nvidia.com'].uuid == '{uuid3}'")])
    other = claim("other", [exactly("gpu", GPU, f"device.attributes['gpu.nvidia.com'].uuid != '{uuid3}'")])
    for _ in range(2):
        assert devices_of(schedule([this], classes, index, AllocatedState(), ["h100-node"]), "default/this") == [
            "gpu-3"
        ]
        assert devices_of(schedule([other], classes, index, AllocatedState(), ["h100-node"]), "default/other") == [
            "gpu-0"
        ]


def test_kept_filter_results_follow_who_holds_each_device(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    index = SliceIndex(h100_slices)
    state = AllocatedState()
    held = {}
    for i in range(8):
        c = claim(f"c{i}", [exactly("gpu")])
        out = schedule([c], classes, index, state, ["h100-node"])
        held[devices_of(out, f"default/c{i}")[0]] = commit(state, c, out)
    assert sorted(held) == sorted(f"gpu-{i}" for i in range(8))
    full = schedule([claim("late", [exactly("gpu")])], classes, index, state, ["h100-node"])
    assert full.node is None
    assert sum(r.count for r in full.reports[0].requests[0].rejections) == 8
    assert {r.reason for r in full.reports[0].requests[0].rejections} == {
        f"already allocated to claim default/c{i}" for i in range(8)
    }
    state.remove_claim(held["gpu-5"])
    again = schedule([claim("late", [exactly("gpu")])], classes, index, state, ["h100-node"])
    assert devices_of(again, "default/late") == ["gpu-5"]
    assert again.reports[0].requests[0].eligible == 1
    # Another AllocatedState (built, not changed through add/remove) is another stamp.
    one_held = AllocatedState({(GPU, "h100-node", "gpu-0"): "x/a"})
    assert devices_of(
        schedule([claim("p", [exactly("gpu")])], classes, index, one_held, ["h100-node"]), "default/p"
    ) == ["gpu-1"]
    assert devices_of(
        schedule([claim("q", [exactly("gpu")])], classes, index, AllocatedState(), ["h100-node"]), "default/q"
    ) == ["gpu-0"]
