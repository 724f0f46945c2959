from typing import Any

import msgspec

from services.dashboard import model, trim
from services.dashboard.model import Allocation, Health, Sharing, allocations_of, node_row


def _slice(node: str, devices: list[dict[str, Any]], driver: str = "gpu.nvidia.com") -> dict[str, Any]:
    return {"spec": {"driver": driver, "nodeName": node, "pool": {"name": node}, "devices": devices}}


def _claim(ns: str, name: str, node: str, device: str, config: list[Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}", "creationTimestamp": "2026-12-04T10:00:00Z"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": node, "device": device}],
                    "config": config or [],
                }
            },
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "1"}],
        },
    }


def _allocs(*claims: dict[str, Any]) -> dict[model.DeviceKey, list[Allocation]]:
    out: dict[model.DeviceKey, list[Allocation]] = {}
    for claim in claims:
        for key, allocation in allocations_of(claim).items():
            out.setdefault(key, []).append(allocation)
    return out


H100 = {"productName": {"string": "NVIDIA H100"}, "uuid": {"string": "GPU-a"}}
TIME_SLICED = [
    {
        "source": "FromClaim",
        "requests": [],
        "opaque": {
            "driver": "gpu.nvidia.com",
            "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "GpuConfig",
                "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
            },
        },
    }
]


def test_a_row_marks_taints_xid_claims_and_sharing() -> None:
    devices: list[dict[str, Any]] = [
        {
            "name": "gpu-0",
            "attributes": H100,
            "capacity": {"memory": {"value": "80Gi"}},
            "taints": [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}],
        },
        {"name": "gpu-1", "attributes": H100},
    ]
    claims = [_claim("t", "a", "n", "gpu-1", TIME_SLICED), _claim("u", "b", "n", "gpu-1", TIME_SLICED)]
    row = node_row("n", [_slice("n", devices)], None, _allocs(*claims), {})
    g0, g1 = row.devices
    assert (g0.state, g0.xid, g0.memory_bytes, g0.taints[0].effect) == ("tainted", 79, 80 << 30, "NoSchedule")
    assert g1.state == "claimed" and [a.claim for a in g1.allocations] == ["a", "b"]
    assert g1.allocations[0].sharing == Sharing(mode="time-slicing", interval="Long")
    assert g1.allocations[0].pods == ["t/p"]
    assert model.node_counters(row) == {"NVIDIA H100": {"free": 0, "claimed": 1, "tainted": 1}}


def test_live_health_taints_before_the_slice_does() -> None:
    row = node_row(
        "n", [_slice("n", [{"name": "gpu-0", "attributes": H100}])], None, {}, {"gpu-0": Health(unhealthy=True, xid=48)}
    )
    assert (row.devices[0].state, row.devices[0].xid) == ("tainted", 48)


def test_dynamic_mig_places_partitions_on_the_counter_slots() -> None:
    full: dict[str, Any] = {
        "name": "gpu-0",
        "attributes": {**H100, "type": {"string": "gpu"}},
        "consumesCounters": [
            {"counterSet": "gpu-0-counter-set", "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}
        ],
    }
    part: dict[str, Any] = {
        "name": "gpu-0-mig-2g20gb-14-2",
        "attributes": {"type": {"string": "mig"}, "profile": {"string": "2g.20gb"}},
        "consumesCounters": [
            {
                "counterSet": "gpu-0-counter-set",
                "counters": {"memory-slice-2": {"value": "1"}, "memory-slice-3": {"value": "1"}},
            }
        ],
    }
    row = node_row("n", [_slice("n", [part, full])], None, _allocs(_claim("t", "c", "n", part["name"])), {})
    assert [d.name for d in row.devices] == ["gpu-0", "gpu-0-mig-2g20gb-14-2"]
    assert row.devices[0].mig_slots == 8
    p = row.devices[1]
    assert (p.type, p.parent, p.state) == ("partition", "gpu-0", "claimed")
    assert msgspec.to_builtins(p.mig) == {"profile": "2g.20gb", "start": 2, "size": 2}


def test_groups_domains_then_cliques_then_ungrouped_and_ready_from_conditions() -> None:
    cd = _slice(
        "b", [{"name": "channel-0", "attributes": {"cliqueID": {"string": "uuid.3"}}}], "compute-domain.nvidia.com"
    )
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    rows = [
        node_row("c", [_slice("c", [])], None, {}, {}),
        node_row("b", [cd, _slice("b", [])], ready, {}, {}),
        node_row("a", [_slice("a", [])], None, {}, {}, domains=["ns/dom"]),
    ]
    assert rows[1].clique == "uuid.3" and rows[1].ready and not rows[0].ready
    assert [(g.name, g.nodes) for g in model.groups(rows)] == [
        ("domain ns/dom", ["a"]),
        ("clique uuid.3", ["b"]),
        ("ungrouped", ["c"]),
    ]


def test_redact_hides_other_tenants_names_only() -> None:
    row = node_row(
        "n",
        [_slice("n", [{"name": "gpu-0", "attributes": H100}])],
        None,
        _allocs(_claim("mine", "a", "n", "gpu-0"), _claim("theirs", "b", "n", "gpu-0")),
        {},
    )
    seen = model.redact(row, frozenset({"mine"}))
    mine, theirs = seen.devices[0].allocations
    assert (mine.namespace, mine.claim) == ("mine", "a")
    assert (theirs.namespace, theirs.claim, theirs.claim_uid, theirs.pods, theirs.other_tenant) == (
        "",
        "",
        "",
        [],
        True,
    )
    assert model.redact(row, None) is row and row.devices[0].allocations[1].claim == "b"  # the shared row is untouched


def test_explain_text_keeps_the_viewers_claims_named_and_unnames_the_others() -> None:
    text = (
        "claim team-a/job: not allocated\n    1 rejected: already allocated to claim team-a/old (gpu-0)\n"
        "    2 rejected: already allocated to claim team-b/secret.v2 (gpu-1, gpu-2)"
    )
    seen = model.redact_text(text, frozenset({"team-a"}))
    assert seen == (
        "claim team-a/job: not allocated\n    1 rejected: already allocated to claim team-a/old (gpu-0)\n"
        "    2 rejected: already allocated to another tenant's claim (gpu-1, gpu-2)"
    )
    assert model.redact_text(text, None) == text


def _share(ns: str, name: str, memory: str, compute: str, share_id: str) -> dict[str, Any]:
    claim = _claim(ns, name, "n", "gpu-0")
    claim["status"]["allocation"]["devices"]["results"][0].update(
        {"shareID": share_id, "consumedCapacity": {"memory": memory, "compute": compute}}
    )
    return claim


SHARED_GPU: dict[str, Any] = {
    "name": "gpu-0",
    "attributes": H100,
    "allowMultipleAllocations": True,
    "capacity": {"memory": {"value": "80Gi", "requestPolicy": {"default": "1Mi"}}, "compute": {"value": "100"}},
}


def test_a_shared_gpu_shows_each_tenants_share_and_the_capacity_left() -> None:
    # as the state keeps them: the informers' transforms must keep shares and capacities
    rslice = trim.trim_slice({"metadata": {"name": "s"}, **_slice("n", [SHARED_GPU])})
    claims = [
        trim.trim_claim(_share("mine", "a", "10Gi", "10", "s-a")),
        trim.trim_claim(_share("theirs", "b", "30Gi", "40", "s-b")),
    ]
    row = node_row("n", [rslice], None, _allocs(*claims), {})
    [gpu] = row.devices
    assert gpu.shared and gpu.state == "claimed"
    assert [(a.namespace, a.claim, a.share) for a in gpu.allocations] == [
        ("mine", "a", model.Share(id="s-a", memory_bytes=10 << 30, compute=10)),
        ("theirs", "b", model.Share(id="s-b", memory_bytes=30 << 30, compute=40)),
    ]
    assert gpu.capacity_left == model.Capacity(memory_bytes=40 << 30, compute=50)
    body = msgspec.to_builtins(gpu)
    assert body["capacityLeft"] == {"memoryBytes": 40 << 30, "compute": 50, "shares": None}
    assert body["allocations"][0]["share"] == {"id": "s-a", "memoryBytes": 10 << 30, "compute": 10, "shares": None}

    [seen] = model.redact(row, frozenset({"mine"})).devices
    mine, theirs = seen.allocations
    assert (mine.namespace, mine.claim, mine.share) == ("mine", "a", gpu.allocations[0].share)
    assert (theirs.namespace, theirs.claim, theirs.claim_uid, theirs.pods, theirs.other_tenant) == (
        "",
        "",
        "",
        [],
        True,
    )
    assert theirs.share == model.Share(id="", memory_bytes=30 << 30, compute=40)  # its size, not its id
    assert seen.capacity_left == gpu.capacity_left
    assert "s-b" not in msgspec.json.encode(seen).decode() and "theirs" not in msgspec.json.encode(seen).decode()


def test_a_whole_gpu_and_a_share_without_capacity_names() -> None:
    whole = node_row(
        "n", [_slice("n", [{"name": "gpu-0", "attributes": H100}])], None, _allocs(_claim("t", "a", "n", "gpu-0")), {}
    )
    assert (whole.devices[0].shared, whole.devices[0].capacity_left, whole.devices[0].allocations[0].share) == (
        False,
        None,
        None,
    )
    counted = {**SHARED_GPU, "capacity": {"memory": {"value": "80Gi"}, "shares": {"value": "4"}}}
    claim = _claim("t", "a", "n", "gpu-0")
    claim["status"]["allocation"]["devices"]["results"][0].update({"shareID": "s", "consumedCapacity": {"shares": "1"}})
    [gpu] = node_row("n", [_slice("n", [counted])], None, _allocs(claim), {}).devices
    assert gpu.allocations[0].share == model.Share(id="s", shares=1)
    assert gpu.capacity_left == model.Capacity(memory_bytes=80 << 30, shares=3)
