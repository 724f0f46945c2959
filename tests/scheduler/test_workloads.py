"""Every reference workload's claims (but VFIO and IMEX) allocate as the manifests' comments say."""

from __future__ import annotations

import copy
from typing import Any

from embedded.scheduler.allocator import AllocatedState, schedule
from embedded.scheduler.explain import node_lines
from embedded.scheduler.simslices import node_slices
from tests.scheduler.conftest import template_claim, workload

GPU = "gpu.nvidia.com"


def allocate_pods(
    claims: list[dict[str, Any]], classes: list[dict[str, Any]], slices: list[dict[str, Any]], node: str
) -> list[dict[str, Any]]:
    """One claim per pod, pods one after another (as the scheduler does): each claim's allocation."""
    state = AllocatedState()
    out = []
    for c in claims:
        result = schedule([c], classes, slices, state, [node])
        key = f"{c['metadata']['namespace']}/{c['metadata']['name']}"
        assert result.node == node, result.reports
        done = copy.deepcopy(c)
        done["status"] = {"allocation": result.allocations[key]}
        state.add_claim(done)
        out.append(result.allocations[key])
    return out


def per_pod(docs: list[dict[str, Any]], pods: int) -> list[dict[str, Any]]:
    base = template_claim(docs)
    claims = []
    for i in range(pods):
        c = copy.deepcopy(base)
        c["metadata"]["name"] = f"pod{i}-claim"
        claims.append(c)
    return claims


def results(allocation: dict[str, Any]) -> list[dict[str, Any]]:
    return list(allocation["devices"]["results"])


def test_gpu_test1_two_pods_get_distinct_gpus(h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]) -> None:
    allocs = allocate_pods(per_pod(workload("gpu-test1"), 2), classes, h100_slices, "h100-node")
    devices = [r["device"] for a in allocs for r in results(a)]
    assert len(devices) == 2 and len(set(devices)) == 2


def test_gpu_test2_one_claim_shared_by_two_containers(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    (alloc,) = allocate_pods(per_pod(workload("gpu-test2"), 1), classes, h100_slices, "h100-node")
    assert [r["request"] for r in results(alloc)] == ["gpu"]  # one device, which both containers reference


def test_gpu_test3_global_claim(h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]) -> None:
    docs = workload("gpu-test3")
    c = template_claim(docs)
    assert c["metadata"]["name"] == "single-gpu"
    (alloc,) = allocate_pods([c], classes, h100_slices, "h100-node")
    assert len(results(alloc)) == 1


def test_gpu_test4_four_mig_devices_on_one_parent_per_replica(a100_mig_inv: Any, classes: list[dict[str, Any]]) -> None:
    slices = node_slices(a100_mig_inv, mig_mode="dynamic", minor=35)
    parent: dict[str, str] = {}
    for s in slices:
        for d in s["spec"].get("devices") or []:
            if "parentUUID" in d["attributes"]:
                parent[d["name"]] = d["attributes"]["parentUUID"]["string"]
    allocs = allocate_pods(per_pod(workload("gpu-test4"), 4), classes, slices, "a100-mig")
    parents_per_pod = []
    for alloc in allocs:
        res = results(alloc)
        assert [r["request"] for r in res] == ["mig-1g-5gb-0", "mig-1g-5gb-1", "mig-2g-10gb", "mig-3g-20gb"]
        assert len({r["device"] for r in res}) == 4
        parents = {parent[r["device"]] for r in res}
        assert len(parents) == 1  # matchAttribute parentUUID
        parents_per_pod.append(parents.pop())
    assert len(set(parents_per_pod)) == 4  # a 40 GB A100 holds one such set; each replica gets its own GPU


def test_gpu_test5_two_gpus_with_their_own_sharing_configs(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    (alloc,) = allocate_pods(per_pod(workload("gpu-test5"), 1), classes, h100_slices, "h100-node")
    res = results(alloc)
    assert [r["request"] for r in res] == ["ts-gpu", "mps-gpu"] and res[0]["device"] != res[1]["device"]
    config = alloc["devices"]["config"]
    assert [(c["source"], c["requests"], c["opaque"]["parameters"]["sharing"]["strategy"]) for c in config] == [
        ("FromClaim", ["ts-gpu"], "TimeSlicing"),
        ("FromClaim", ["mps-gpu"], "MPS"),
    ]


def test_gpu_test_mps_config_reaches_the_allocation(
    h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    (alloc,) = allocate_pods(per_pod(workload("gpu-test-mps"), 1), classes, h100_slices, "h100-node")
    (config,) = alloc["devices"]["config"]
    assert config["source"] == "FromClaim" and "requests" not in config  # the claim's only request
    assert config["opaque"]["parameters"]["sharing"]["mpsConfig"]["defaultActiveThreadPercentage"] == 50


def test_gpu_test6_removed_index_attribute_is_explained(
    a100_inv: Any, h100_slices: list[dict[str, Any]], classes: list[dict[str, Any]]
) -> None:
    c = per_pod(workload("gpu-test6"), 1)[0]
    a100 = node_slices(a100_inv)
    out = schedule([c], classes, [*h100_slices, *a100], AllocatedState(), ["h100-node", "a100-node"])
    assert out.node is None
    h100, a100_report = out.reports
    assert h100.requests[0].rejections[0].count == 8  # not A100: the selector is false, no error
    assert "productName.lowerAscii().matches" in h100.requests[0].rejections[0].reason
    assert "no such key: index" in a100_report.requests[0].error
    text = "\n".join(node_lines(a100_report))
    assert "no such key: index" in text and "gpu-0" in text
