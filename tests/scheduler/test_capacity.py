"""Consumable capacity (KEP-5075): shares of one device across claims, through the real allocator,
the scheduler loop and the API server."""

from __future__ import annotations

import asyncio
import copy
import re
from typing import Any

import pytest

from embedded.scheduler.allocator import AllocatedState, schedule
from embedded.scheduler.explain import condition_message, report_text
from shared.kube.resources import EVENTS, NAMESPACES, NODES, PODS, RESOURCECLAIMS, RESOURCESLICES
from tests.polling import eventually
from tests.scheduler.conftest import claim, exactly
from tests.scheduler.loophelpers import cluster, condition, ready_node
from tests.scheduler.test_explain_cli import explain

GPU = "gpu.nvidia.com"
NODE = "share-node"
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def gpu(
    name: str, memory: str = "80Gi", shareable: bool = True, policy: dict[str, Any] | None = None, **capacity: Any
) -> dict[str, Any]:
    mem: dict[str, Any] = {"value": memory}
    if policy is not None:
        mem["requestPolicy"] = policy
    device: dict[str, Any] = {
        "name": name,
        "attributes": {"type": {"string": "gpu"}},
        "capacity": {"memory": mem, **capacity},
    }
    if shareable:
        device["allowMultipleAllocations"] = True
    return device


def gpu_slice(*devices: dict[str, Any], node: str = NODE, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpus"},
        "spec": {
            "driver": GPU,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": list(devices),
            **spec,
        },
    }


def mem_request(name: str = "gpu", memory: str | None = "10Gi", **extra: Any) -> dict[str, Any]:
    if memory is not None:
        extra["capacity"] = {"requests": {"memory": memory}}
    return exactly(name, GPU, **extra)


def key(c: dict[str, Any]) -> str:
    return f"{c['metadata']['namespace']}/{c['metadata']['name']}"


class Cluster:
    """Claims scheduled one at a time over the same slices, each committed before the next."""

    def __init__(self, classes: list[dict[str, Any]], slices: list[dict[str, Any]]):
        self.classes = classes
        self.slices = slices
        self.state = AllocatedState()
        self.done: dict[str, dict[str, Any]] = {}  # namespace/name -> the claim as committed

    def place(self, c: dict[str, Any]) -> Any:
        out = schedule([c], self.classes, self.slices, self.state, [NODE])
        if out.node is not None:
            done = copy.deepcopy(c)
            done["status"] = {"allocation": out.allocations[key(c)]}
            self.state.add_claim(done)
            self.done[key(c)] = done
        return out


def results(out: Any) -> list[dict[str, Any]]:
    return [r for a in out.allocations.values() for r in a["devices"]["results"]]


def test_eight_tenants_share_one_gpu_and_the_ninth_is_told_why(classes: list[dict[str, Any]]) -> None:
    cl = Cluster(classes, [gpu_slice(gpu("gpu-0"))])
    placed = [cl.place(claim("train", [mem_request()], namespace=f"tenant-{i}")) for i in range(8)]
    shares = [results(o)[0] for o in placed]
    assert all(o.node == NODE for o in placed)
    assert {r["device"] for r in shares} == {"gpu-0"}
    assert all(r["consumedCapacity"] == {"memory": "10Gi"} for r in shares)
    assert len({r["shareID"] for r in shares}) == 8 and all(UUID_RE.match(r["shareID"]) for r in shares)

    ninth = cl.place(claim("train", [mem_request()], namespace="tenant-8"))
    assert ninth.node is None
    message = condition_message(ninth.reports)
    assert "not enough capacity left (gpu-0: memory 0 of 80Gi left, request needs 10Gi)" in message
    assert "gpu-0: memory 0 of 80Gi left, request needs 10Gi" in report_text(ninth.reports)


def test_a_request_larger_than_what_is_left_names_the_capacity_left(classes: list[dict[str, Any]]) -> None:
    cl = Cluster(classes, [gpu_slice(gpu("gpu-0"), gpu("gpu-1", memory="40Gi"))])
    assert cl.place(claim("big", [mem_request(memory="70Gi")])).node == NODE  # only gpu-0 is big enough
    out = cl.place(claim("more", [mem_request(memory="20Gi")]))
    assert results(out)[0]["device"] == "gpu-1"
    out = cl.place(claim("again", [mem_request(memory="25Gi")]))
    assert out.node is None
    text = report_text(out.reports)
    assert "gpu-0: memory 10Gi of 80Gi left, request needs 25Gi" in text
    assert "gpu-1: memory 20Gi of 40Gi left, request needs 25Gi" in text


RANGE = {"default": "1Gi", "validRange": {"min": "1Gi", "max": "40Gi", "step": "1Gi"}}
VALUES = {"default": "10Gi", "validValues": ["10Gi", "20Gi", "40Gi"]}


@pytest.mark.parametrize(
    ("policy", "asked", "consumed"),
    [
        (RANGE, "1500Mi", "2Gi"),  # rounded up to min + n*step
        (RANGE, "100Mi", "1Gi"),  # below min: min
        (RANGE, None, "1Gi"),  # no request: the default
        ({"default": "1Gi", "validRange": {"min": "4Gi", "step": "3Gi"}}, "5Gi", "7Gi"),  # steps count from min
        (VALUES, "11Gi", "20Gi"),  # the next valid value
        (VALUES, "20Gi", "20Gi"),
        (VALUES, None, "10Gi"),
        (None, "1500Mi", "1500Mi"),  # no policy: as asked
        (None, None, "80Gi"),  # no policy and no request: the whole capacity
    ],
)
def test_consumed_capacity_follows_the_request_policy(
    classes: list[dict[str, Any]], policy: Any, asked: Any, consumed: str
) -> None:
    cl = Cluster(classes, [gpu_slice(gpu("gpu-0", policy=policy))])
    out = cl.place(claim("c", [mem_request(memory=asked)]))
    assert results(out)[0]["consumedCapacity"] == {"memory": consumed}


def test_rounding_counts_against_what_is_left(classes: list[dict[str, Any]]) -> None:
    cl = Cluster(classes, [gpu_slice(gpu("gpu-0", memory="4Gi", policy=RANGE))])
    assert cl.place(claim("a", [mem_request(memory="1500Mi")])).node == NODE  # 2Gi
    assert cl.place(claim("b", [mem_request(memory="1500Mi")])).node == NODE  # 2Gi: full
    out = cl.place(claim("c", [mem_request(memory="100Mi")]))
    assert out.node is None
    assert "gpu-0: memory 0 of 4Gi left, request needs 1Gi" in report_text(out.reports)


@pytest.mark.parametrize(
    ("policy", "asked", "why"),
    [
        (RANGE, "41Gi", "capacity memory: request 41Gi is above the maximum 40Gi"),
        (VALUES, "41Gi", "capacity memory: request 41Gi is above every valid value (10Gi, 20Gi, 40Gi)"),
    ],
)
def test_a_request_the_policy_does_not_allow_is_unsatisfiable(
    classes: list[dict[str, Any]], policy: Any, asked: str, why: str
) -> None:
    cl = Cluster(classes, [gpu_slice(gpu("gpu-0", policy=policy))])
    out = cl.place(claim("c", [mem_request(memory=asked)]))
    assert out.node is None
    message = condition_message(out.reports)
    assert f"capacity request not allowed by the device's requestPolicy (gpu-0: {why})" in message


def test_freeing_a_claim_gives_its_capacity_back(classes: list[dict[str, Any]]) -> None:
    cl = Cluster(classes, [gpu_slice(gpu("gpu-0"))])
    assert cl.place(claim("first", [mem_request(memory="60Gi")])).node == NODE
    assert cl.place(claim("second", [mem_request(memory="30Gi")])).node is None
    cl.state.remove_claim(cl.done.pop("default/first"))
    assert cl.place(claim("second", [mem_request(memory="30Gi")])).node == NODE
    # A state rebuilt from the remaining claims agrees: 50Gi left.
    cl.state = AllocatedState.from_claims(cl.done.values())
    assert cl.place(claim("third", [mem_request(memory="60Gi")])).node is None
    assert cl.place(claim("third", [mem_request(memory="50Gi")])).node == NODE


def test_several_shares_of_one_device_in_one_claim_count_together(classes: list[dict[str, Any]]) -> None:
    cl = Cluster(classes, [gpu_slice(gpu("gpu-0"))])
    out = cl.place(claim("pair", [mem_request("a", "30Gi"), mem_request("b", "30Gi")]))
    shares = results(out)
    assert [r["device"] for r in shares] == ["gpu-0", "gpu-0"] and shares[0]["shareID"] != shares[1]["shareID"]
    out = cl.place(claim("trio", [mem_request("a", "30Gi"), mem_request("b", "30Gi"), mem_request("c", "30Gi")]))
    assert out.node is None
    # Within one pass: 80Gi holds two 30Gi shares, not three.
    cl2 = Cluster(classes, [gpu_slice(gpu("gpu-0"))])
    out = cl2.place(claim("trio", [mem_request("a", "30Gi"), mem_request("b", "30Gi"), mem_request("c", "30Gi")]))
    assert out.node is None
    assert "capacity taken by this pod's other requests (memory 20Gi of 80Gi left, request needs 30Gi)" in report_text(
        out.reports
    )


def test_a_device_without_multiple_allocations_stays_exclusive(classes: list[dict[str, Any]]) -> None:
    cl = Cluster(classes, [gpu_slice(gpu("gpu-0", shareable=False))])
    first = results(cl.place(claim("first", [mem_request()])))
    assert first == [{"request": "gpu", "driver": GPU, "pool": NODE, "device": "gpu-0"}]  # no shareID
    out = cl.place(claim("second", [mem_request()]))
    assert out.node is None
    assert "already allocated to claim default/first" in condition_message(out.reports)


def test_a_whole_allocation_of_a_shareable_device_blocks_shares(classes: list[dict[str, Any]]) -> None:
    cl = Cluster(classes, [gpu_slice(gpu("gpu-0"))])
    legacy = claim("legacy", [mem_request()])
    legacy["status"] = {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": GPU, "pool": NODE, "device": "gpu-0"}]}}
    }  # no shareID
    cl.state.add_claim(legacy)
    assert cl.place(claim("new", [mem_request()])).node is None


def test_shared_counters_are_consumed_once_per_shareable_device(classes: list[dict[str, Any]]) -> None:
    counters = [{"name": "gpu-0-set", "counters": {"memory": {"value": "80Gi"}}}]
    shared = gpu("gpu-0-shared")
    shared["consumesCounters"] = [{"counterSet": "gpu-0-set", "counters": {"memory": {"value": "80Gi"}}}]
    whole = gpu("gpu-0-whole", shareable=False)
    whole["consumesCounters"] = [{"counterSet": "gpu-0-set", "counters": {"memory": {"value": "80Gi"}}}]
    cl = Cluster(classes, [gpu_slice(shared, whole, sharedCounters=counters)])
    pick_shared = "device.allowMultipleAllocations"
    first = cl.place(claim("a", [mem_request(selectors=[{"cel": {"expression": pick_shared}}])]))
    second = cl.place(claim("b", [mem_request(selectors=[{"cel": {"expression": pick_shared}}])]))
    assert cl.state.in_use().keys() == {(GPU, NODE, "gpu-0-shared")}
    assert [results(o)[0]["device"] for o in (first, second)] == ["gpu-0-shared", "gpu-0-shared"]
    out = cl.place(claim("c", [mem_request(selectors=[{"cel": {"expression": "!" + pick_shared}}])]))
    assert out.node is None and "counters used up" in condition_message(out.reports)
    cl.state.remove_claim(cl.done["default/a"])
    cl.state.remove_claim(cl.done["default/b"])
    assert results(cl.place(claim("c", [mem_request()])))[0]["device"] in ("gpu-0-shared", "gpu-0-whole")


# ---- through the scheduler loop and the API server ----------------------------------------------------------


async def test_loop_binds_eight_tenants_to_one_gpu_and_leaves_the_ninth_pending(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=0) as c:
        await c.kube.create(RESOURCESLICES, None, gpu_slice(gpu("gpu-0")))
        await c.kube.create(NODES, None, ready_node(NODE))
        for i in range(9):
            ns = f"tenant-{i}"
            await c.kube.create(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            await c.kube.create(RESOURCECLAIMS, ns, claim("share", [mem_request()], namespace=ns))
            await c.pod("train", [{"name": "gpu", "resourceClaimName": "share"}], namespace=ns)

        async def settled() -> Any:
            pods = [await c.get_pod("train", f"tenant-{i}") for i in range(9)]
            bound = [p for p in pods if p["spec"].get("nodeName")]
            waiting = [p for p in pods if (condition(p) or {}).get("status") == "False"]
            return (bound, waiting) if len(bound) == 8 and len(waiting) == 1 else None

        bound, waiting = await eventually(settled, what="8 pods bound, 1 unschedulable")
        shares = []
        for p in bound:
            got = await c.kube.get(RESOURCECLAIMS, p["metadata"]["namespace"], "share")
            shares += got["status"]["allocation"]["devices"]["results"]
        assert {r["device"] for r in shares} == {"gpu-0"} and len({r["shareID"] for r in shares}) == 8
        assert all(r["consumedCapacity"] == {"memory": "10Gi"} for r in shares)
        pending = waiting[0]
        ns = pending["metadata"]["namespace"]
        unschedulable = condition(pending)
        assert unschedulable is not None
        assert "gpu-0: memory 0 of 80Gi left, request needs 10Gi" in unschedulable["message"]
        events, _ = await c.kube.list(EVENTS, ns)
        failed = [e for e in events if e["reason"] == "FailedScheduling"]
        assert failed and "not enough capacity left" in failed[0]["message"]
        # `gpu-dra explain` names the capacity left on the device, and what each share consumes.
        why, share = await asyncio.gather(
            explain(c.api.kubeconfig_path, "pod", f"{ns}/train"),
            explain(c.api.kubeconfig_path, "claim", f"{bound[0]['metadata']['namespace']}/share"),
        )
        assert why.returncode == 0, why.stderr
        assert "not enough capacity left (gpu-0: memory 0 of 80Gi left, request needs 10Gi)" in why.stdout
        assert share.returncode == 0, share.stderr
        assert re.search(r"device gpu-0 \(share [0-9a-f-]{36}: memory 10Gi\)", share.stdout), share.stdout
        assert "  device gpu-0: 8 shares; left: memory 0 of 80Gi" in share.stdout, share.stdout

        # Freeing one tenant's share lets the pending pod in.
        done = bound[0]
        await c.kube.delete(PODS, done["metadata"]["namespace"], "train")
        await c.kube.patch(
            RESOURCECLAIMS,
            done["metadata"]["namespace"],
            "share",
            {"status": {"allocation": None, "reservedFor": None}},
            subresource="status",
        )

        async def in_now() -> Any:
            return (await c.get_pod("train", ns))["spec"].get("nodeName")

        assert await eventually(in_now, what="the pending tenant bound after a share was freed") == NODE
