"""The scheduler loop against the embedded API server: claim generation, allocation, binding, freeing."""

from __future__ import annotations

from typing import Any

from embedded.scheduler.loop import Scheduler
from embedded.scheduler.simslices import node_slices
from embedded.scheduler.state import WATCHED
from shared.kube.resources import EVENTS, NAMESPACES, NODES, PODS, RESOURCECLAIMS, RESOURCECLAIMTEMPLATES
from tests.polling import eventually
from tests.scheduler.loophelpers import add_node, cluster, condition, devices_of

GPU = {"deviceClassName": "gpu.nvidia.com"}


def template(name: str, selector: str = "", count: int = 1) -> dict[str, Any]:
    exactly: dict[str, Any] = {**GPU, "count": count}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }


def named_claim(name: str, count: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {**GPU, "count": count}}]}},
    }


def from_template(tpl: str = "one-gpu") -> list[dict[str, Any]]:
    return [{"name": "gpu", "resourceClaimTemplateName": tpl}]


async def bound(c: Any, name: str) -> dict[str, Any]:
    async def probe() -> Any:
        pod = await c.get_pod(name)
        return pod if pod["spec"].get("nodeName") else None

    result: dict[str, Any] = await eventually(probe, what=f"pod {name} bound")
    return result


async def claim_of(c: Any, pod: dict[str, Any]) -> dict[str, Any]:
    statuses = pod["status"].get("resourceClaimStatuses") or []
    name = statuses[0]["resourceClaimName"] if statuses else pod["spec"]["resourceClaims"][0]["resourceClaimName"]
    claim: dict[str, Any] = await c.kube.get(RESOURCECLAIMS, "default", name)
    return claim


async def test_template_claim_is_generated_allocated_reserved_and_pod_bound(tmp_path, h100_inv, spans):
    async with cluster(tmp_path, h100_inv) as c:
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("one-gpu"))
        created = await c.pod("p1", from_template())
        pod = await bound(c, "p1")
        statuses = pod["status"]["resourceClaimStatuses"]
        assert [s["name"] for s in statuses] == ["gpu"]
        claim = await claim_of(c, pod)
        assert claim["metadata"]["name"].startswith("p1-gpu-")
        assert claim["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"] == "gpu"
        [ref] = claim["metadata"]["ownerReferences"]
        assert ref["uid"] == created["metadata"]["uid"] and ref["controller"] and ref["blockOwnerDeletion"]
        [device] = devices_of(claim)
        assert device[1] == pod["spec"]["nodeName"]
        assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": "p1", "uid": created["metadata"]["uid"]}]
        assert claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [
            pod["spec"]["nodeName"]
        ]
        assert (condition(pod) or {}).get("status") == "True"
        events, _ = await c.kube.list(EVENTS, "default")
        assert any(e["reason"] == "Scheduled" and e["involvedObject"]["name"] == "p1" for e in events)
    attempts = [
        sp
        for sp in spans.get_finished_spans()
        if sp.name == "scheduler.schedule_pod" and sp.attributes.get("k8s.pod.uid") == created["metadata"]["uid"]
    ]
    assert attempts and attempts[-1].attributes["k8s.node.name"] == pod["spec"]["nodeName"]
    assert attempts[-1].attributes["gpu_dra.outcome"] == "bound"


async def test_pods_never_share_devices_and_spread_over_nodes(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=2, start=False) as c:
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("two-gpus", count=2))
        for i in range(8):  # 16 GPUs on 2 nodes of 8: exactly full
            await c.pod(f"p{i}", from_template("two-gpus"))
        await c.pod("extra", from_template("two-gpus"))
        # Started after the pods exist, the scheduler decides them all in one pass, before any watch
        # event about its own writes: only its in-memory cache keeps two pods off the same device.
        await c.start_scheduler()
        pods = [await bound(c, f"p{i}") for i in range(8)]
        devices = [d for p in pods for d in devices_of(await claim_of(c, p))]
        assert len(devices) == 16 and len(set(devices)) == 16
        assert sorted(p["spec"]["nodeName"] for p in pods) == ["node-0"] * 4 + ["node-1"] * 4

        async def unschedulable() -> Any:
            cond = condition(await c.get_pod("extra"))
            return cond if cond and cond["status"] == "False" else None

        cond = await eventually(unschedulable, what="extra pod unschedulable")
        assert cond["reason"] == "Unschedulable" and "0/2 nodes" in cond["message"]
        assert not (await c.get_pod("extra"))["spec"].get("nodeName")


async def test_shared_claim_across_two_pods(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=3) as c:
        await c.kube.create(RESOURCECLAIMS, "default", named_claim("shared", count=2))
        claims = [{"name": "gpu", "resourceClaimName": "shared"}]
        a = await c.pod("a", claims)
        b = await c.pod("b", claims)
        pa, pb = await bound(c, "a"), await bound(c, "b")
        assert pa["spec"]["nodeName"] == pb["spec"]["nodeName"]
        claim = await c.kube.get(RESOURCECLAIMS, "default", "shared")
        assert len(devices_of(claim)) == 2
        assert {r["uid"] for r in claim["status"]["reservedFor"]} == {a["metadata"]["uid"], b["metadata"]["uid"]}
        # Deleting one consumer keeps the allocation; deleting both frees it.
        await c.kube.delete(PODS, "default", "a")

        async def reserved_for_b_only() -> Any:
            cl = await c.kube.get(RESOURCECLAIMS, "default", "shared")
            return [r["name"] for r in cl["status"].get("reservedFor") or []] == ["b"] and cl

        cl = await eventually(reserved_for_b_only, what="a removed from reservedFor")
        assert cl["status"]["allocation"]
        await c.kube.delete(PODS, "default", "b")

        async def freed() -> Any:
            cl = await c.kube.get(RESOURCECLAIMS, "default", "shared")
            return not (cl.get("status") or {}).get("allocation")

        await eventually(freed, what="shared claim deallocated")
        assert b["metadata"]["uid"]


async def test_selector_matching_nothing_is_unschedulable_with_the_request_named(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv) as c:
        sel = "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA B200'"
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("b200", selector=sel))
        await c.pod("want-b200", from_template("b200"))

        async def unschedulable() -> Any:
            cond = condition(await c.get_pod("want-b200"))
            return cond if cond and cond["status"] == "False" else None

        cond = await eventually(unschedulable, what="PodScheduled=False")
        assert cond["reason"] == "Unschedulable"
        assert "0/2 nodes can allocate" in cond["message"]
        assert "request gpu" in cond["message"] and "node node-0" in cond["message"]
        events, _ = await c.kube.list(EVENTS, "default")
        failed = [e for e in events if e["reason"] == "FailedScheduling"]
        assert len(failed) == 1 and failed[0]["type"] == "Warning"
        # A later unrelated change retries the pod but neither the condition nor the event is rewritten.
        rv = (await c.get_pod("want-b200"))["metadata"]["resourceVersion"]
        await c.pod("other", from_template("b200"))
        await eventually(unschedulable_pod(c, "other"), what="other pod unschedulable")
        assert (await c.get_pod("want-b200"))["metadata"]["resourceVersion"] == rv


def unschedulable_pod(c: Any, name: str) -> Any:
    async def probe() -> Any:
        cond = condition(await c.get_pod(name))
        return cond if cond and cond["status"] == "False" else None

    return probe


async def test_deleting_a_pod_frees_its_devices_for_a_pending_pod(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=1) as c:
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("eight", count=8))
        await c.pod("first", from_template("eight"))
        first = await bound(c, "first")
        first_claim = await claim_of(c, first)
        await c.pod("second", from_template("eight"))
        await eventually(unschedulable_pod(c, "second"), what="second pending")
        await c.kube.delete(PODS, "default", "first")
        second = await bound(c, "second")
        claim = await claim_of(c, second)
        assert sorted(devices_of(claim)) == sorted(devices_of(first_claim))

        async def generated_claim_gone() -> Any:
            names = [cl["metadata"]["name"] for cl in await c.claims()]
            return first_claim["metadata"]["name"] not in names

        await eventually(generated_claim_gone, what="the first pod's generated claim deleted")


async def test_finished_pod_releases_its_claim(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=1) as c:
        await c.kube.create(RESOURCECLAIMS, "default", named_claim("job-claim", count=8))
        await c.pod("job", [{"name": "gpu", "resourceClaimName": "job-claim"}])
        await bound(c, "job")
        await c.kube.patch(PODS, "default", "job", {"status": {"phase": "Succeeded"}}, subresource="status")

        async def freed() -> Any:
            cl = await c.kube.get(RESOURCECLAIMS, "default", "job-claim")
            return not (cl.get("status") or {}).get("allocation") and not cl["status"].get("reservedFor")

        await eventually(freed, what="claim of the finished pod freed")


async def test_extended_resource_pod_gets_a_claim_with_two_devices(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv) as c:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "legacy", "namespace": "default"},
            "spec": {
                "containers": [{"name": "cuda", "image": "cuda", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]
            },
        }
        created = await c.kube.create(PODS, "default", body)
        pod = await bound(c, "legacy")

        async def with_status() -> Any:
            p = await c.get_pod("legacy")
            return p if (p.get("status") or {}).get("extendedResourceClaimStatus") else None

        pod = await eventually(with_status, what="extendedResourceClaimStatus")
        ext = pod["status"]["extendedResourceClaimStatus"]
        assert ext["requestMappings"] == [
            {"containerName": "cuda", "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"}
        ]
        claim = await c.kube.get(RESOURCECLAIMS, "default", ext["resourceClaimName"])
        assert claim["metadata"]["annotations"]["resource.kubernetes.io/extended-resource-claim"] == "true"
        assert claim["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
        [request] = claim["spec"]["devices"]["requests"]
        assert request["name"] == "container-0-request-0"
        assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com" and request["exactly"]["count"] == 2
        devices = devices_of(claim)
        assert len(devices) == 2 and len(set(devices)) == 2
        assert {d[1] for d in devices} == {pod["spec"]["nodeName"]}


async def test_restart_does_not_double_allocate(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=1) as c:
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("four", count=4))
        await c.pod("a", from_template("four"))
        a = await bound(c, "a")
        await c.stop_scheduler()
        await c.pod("b", from_template("four"))
        await c.pod("c", from_template("four"))
        await c.start_scheduler()
        b = await bound(c, "b")
        await eventually(unschedulable_pod(c, "c"), what="third pod finds the node full")
        claims = await c.claims()
        assert len(claims) == 3  # no second claim for the pods' template entries
        da, db = devices_of(await claim_of(c, a)), devices_of(await claim_of(c, b))
        assert len(da) == 4 and len(db) == 4 and not set(da) & set(db)


async def test_node_checks_taints_and_node_selector(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=2) as c:
        node = await c.kube.get(NODES, None, "node-0")
        node["spec"]["taints"] = [{"key": "maintenance", "effect": "NoSchedule"}]
        await c.kube.replace(NODES, node)
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("one-gpu"))
        for i in range(3):
            await c.pod(f"t{i}", from_template())
        for i in range(3):
            assert (await bound(c, f"t{i}"))["spec"]["nodeName"] == "node-1"
        await c.pod("pinned", from_template(), nodeSelector={"kubernetes.io/hostname": "node-0"})
        cond = await eventually(unschedulable_pod(c, "pinned"), what="pinned pod unschedulable")
        assert "taint maintenance:NoSchedule is not tolerated" in cond["message"]
        # Tolerating the taint lets it in.
        await c.kube.delete(PODS, "default", "pinned")
        await c.pod(
            "tolerant",
            from_template(),
            nodeSelector={"kubernetes.io/hostname": "node-0"},
            tolerations=[{"key": "maintenance", "operator": "Exists"}],
        )
        assert (await bound(c, "tolerant"))["spec"]["nodeName"] == "node-0"


async def test_template_created_after_the_pod_wakes_it(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=1) as c:
        await c.pod("early", from_template("late"))
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("late"))
        await bound(c, "early")


async def test_one_pass_without_any_watch_event_never_reuses_a_device(tmp_path, h100_inv):
    """The cache is updated from each write's answer, not only from the watch (which lags behind)."""
    async with cluster(tmp_path, h100_inv, nodes=1, start=False) as c:
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("two-gpus", count=2))
        for i in range(5):
            await c.pod(f"q{i}", from_template("two-gpus"))
        scheduler = Scheduler(c.client)
        for res in WATCHED:  # listed once; no informer runs, so no event about our writes arrives
            items, _ = await c.kube.list(res)
            scheduler.state.replace_all(res, items)
        await scheduler.run_pass()
        pods = [await c.get_pod(f"q{i}") for i in range(5)]
        assert [p["spec"].get("nodeName") for p in pods] == ["node-0"] * 4 + [None]
        devices = [d for p in pods[:4] for d in devices_of(await claim_of(c, p))]
        assert len(devices) == 8 and len(set(devices)) == 8
        assert (condition(pods[4]) or {}).get("status") == "False"


async def test_a_new_node_wakes_an_unschedulable_pod(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=1) as c:
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("eight", count=8))
        await c.pod("fills", from_template("eight"))
        await bound(c, "fills")
        await c.pod("waits", from_template("eight"))
        await eventually(unschedulable_pod(c, "waits"), what="second pod unschedulable")
        await add_node(c.kube, "node-new", node_slices(h100_inv), h100_inv.node)
        assert (await bound(c, "waits"))["spec"]["nodeName"] == "node-new"


async def test_watch_expired_is_relisted_and_scheduling_goes_on(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=1, start=False) as c:
        scheduler = await c.start_scheduler()  # resync and watch timeouts at their defaults (30 s, 300 s)
        await c.kube.create(NAMESPACES, None, {"metadata": {"name": "bump"}})  # history moves past the pods watch
        c.api.server.store.compact()  # as etcd compaction: the pods watch cannot resume from its version
        hub = c.api.server.hub  # drop every watch stream (as a server restart would), then serve again
        hub.closing.set()
        await eventually(lambda: _true(hub.open_streams == 0), what="watch streams closed")
        hub.closing.clear()

        async def relisted() -> Any:
            return scheduler.lists["pods"] >= 2 and scheduler.lists["resourceclaims"] >= 2

        await eventually(relisted, what="pods and claims re-listed after 410")
        await c.kube.create(RESOURCECLAIMS, "default", named_claim("after"))
        await c.pod("after-relist", [{"name": "gpu", "resourceClaimName": "after"}])
        await bound(c, "after-relist")


async def _true(value: bool) -> bool:
    return value


async def test_a_claim_write_that_conflicts_leaves_no_device_taken_and_the_next_pass_binds(tmp_path, h100_inv):
    """Writes go out while the pass decides the next pods: a failed one puts the cache back as it was."""
    async with cluster(tmp_path, h100_inv, nodes=1, start=False) as c:
        await c.kube.create(RESOURCECLAIMS, "default", named_claim("stale", count=8))
        await c.kube.create(RESOURCECLAIMS, "default", named_claim("fresh", count=8))
        await c.pod("first", [{"name": "gpu", "resourceClaimName": "stale"}])
        await c.pod("second", [{"name": "gpu", "resourceClaimName": "fresh"}])
        scheduler = Scheduler(c.client)
        for res in WATCHED:  # listed once; no informer runs
            items, _ = await c.kube.list(res)
            scheduler.state.replace_all(res, items)
        stale = await c.kube.get(RESOURCECLAIMS, "default", "stale")
        stale["metadata"]["labels"] = {"changed": "behind-the-cache"}
        await c.kube.replace(RESOURCECLAIMS, stale)  # the cached version is behind: its status write gets a 409
        await scheduler.run_pass()
        first, second = await c.get_pod("first"), await c.get_pod("second")
        # "first" took the node's 8 GPUs in the cache, so "second" did not fit; the 409 gave them back
        assert not first["spec"].get("nodeName") and not second["spec"].get("nodeName")
        assert not scheduler.state.assumed and not scheduler.state.allocated.devices
        fresh = scheduler.state.get(RESOURCECLAIMS, "default", "stale")
        assert fresh is not None and fresh["metadata"]["labels"] == {"changed": "behind-the-cache"}  # cached
        assert not (await c.kube.get(RESOURCECLAIMS, "default", "stale")).get("status", {}).get("allocation")
        scheduler.generation += 1  # as the claim's watch event would
        await scheduler.run_pass()
        assert (await c.get_pod("first"))["spec"]["nodeName"] == "node-0"
