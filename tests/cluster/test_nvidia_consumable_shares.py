"""NVIDIA's own consumable-shares demo specs and bats specs, run on a local cluster and judged here.

Source: kubernetes-sigs/dra-driver-nvidia-gpu at 95932046683719c43b6a0dd9613c2e5aad5d6703 (copied verbatim,
with a header naming the path, into tests/fixtures/reference/workloads/consumable-shares/ and
tests/fixtures/reference/bats/). NVIDIA picks the mode with the kubelet plugin's `--consumable-shares` flag
at install time; here each mode is a cluster started with the matching NodeConfig
(examples/node-config/nvidia-consumable-shares-{count,memory,unlimited}.yaml): one node, two H100 80GB, so
"they share" (same UUID) is a choice the scheduler made, not the only GPU there was.

What NVIDIA says each spec shows (demo/specs/consumable-shares/README.md, tests/bats/test_gpu_consumable_shares.bats),
in our words, and what is checked here:

- demo `integer-sharing.yaml` (`--consumable-shares=4`): a 4-replica Deployment whose claim template names no
  capacity; every claim takes 1 of the GPU's 4 `shares` by default, so up to 4 claims share one GPU. Checked:
  the 4 pods Running on one GPU, each claim consuming `shares: 1` (and `memory: 0`, the default of that mode),
  each container printing its `nvidia-smi -L` line and "running with 1 share claim"; scaled to 9 (the
  README's `kubectl scale`), 8 run, 4 per GPU, and the ninth stays Pending for capacity.
- demo `memory-sharing.yaml` (`--consumable-shares=memory`): 2 replicas each asking `memory: 4Gi` co-allocate
  on one GPU. Checked: Running, one GPU, `memory: 4Gi` each, the printed lines. The README also says that in
  this mode a claim naming no amount takes the whole memory: the demo's `unlimited-sharing.yaml` run in memory
  mode shows it (each claim consumes the GPU's 80Gi, the 2 replicas land on the 2 GPUs, a third is Pending).
- demo `unlimited-sharing.yaml` (`--consumable-shares=unlimited`): claims naming no amount take 0 memory, so
  any number share a GPU. Checked: 2 replicas, then 6 (the README's scale command), all Running on one GPU,
  each consuming `memory: 0`.
- bats `gpu-consumable-shares-memory.yaml` and `gpu-consumable-shares-integer.yaml`: the bats file installs the
  driver with `consumableShares=4` for all its tests (so the memory spec also runs in integer mode, as here);
  two independent pods (their own claims from one template, asking `memory: 2Gi` resp. `shares: 1`) are Ready
  within 45 s, each log has "UUID: GPU-" and both logs are equal (the same GPU); deleting the spec removes
  the pods within 30 s. Checked as bats does, plus the consumed capacity and the UUID from the CDI edits.
- bats `gpu-mps.yaml` under consumable shares: NVIDIA's driver refuses MPS when consumable shares are on
  (device_state.go: "MPS sharing is not supported when consumable shares is enabled"), and bats asserts the
  pod is not Ready within 15 s. **Our driver differs on purpose**: an MPS claim config on a share is served
  by the GPU's one MPS daemon (docs/sharing.md, "How the preparer serves a share"), so the pod runs. Asserted
  as that difference: Ready, both containers on one GPU through the GPU's daemon, which runs with the
  config's 50% active threads and 10Gi pinned memory; the share consumes `shares: 1, memory: 0`, and 0
  reserved memory sets no per-client limit (before this test the preparer refused such a share with
  "pinned memory limit '0' must be at least 1Mi"; fixed in shared/claimconfigs.py).

NVIDIA's e2e templates (test/e2e/framework/specs/consumable-shares-{memory,unlimited}.yaml.tmpl) are the
bats pods again with a templated namespace; they are not copied.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from embedded.cluster.local import ClusterConfig, LocalCluster
from services.discovery.config import simulated_state_dir
from shared.claimconfigs import share_daemon_id
from tests.cluster.helpers import apply, device_attributes, edits, pods_in, running
from tests.polling import eventually

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "tests" / "fixtures" / "reference" / "workloads" / "consumable-shares"
BATS = ROOT / "tests" / "fixtures" / "reference" / "bats"
MODES = {
    m: ROOT / "examples" / "node-config" / f"nvidia-consumable-shares-{m}.yaml"
    for m in ("count", "memory", "unlimited")
}
NODE = "gpu-node-0"
GIB = 1 << 30
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]

until = functools.partial(eventually, timeout=90.0, every=0.2)


class Clusters:
    """One cluster at a time, started with a mode's NodeConfig; asking for another mode stops the last."""

    def __init__(self, root: Path):
        self.root = root
        self.mode = ""
        self.current: LocalCluster | None = None

    async def get(self, mode: str) -> LocalCluster:
        if mode != self.mode:
            await self.close()
            cfg = ClusterConfig(
                nodes=1,
                gpus="h100x2",
                node_config=str(MODES[mode]),
                data_dir=str(self.root / mode),
                start_timeout=120,
                compute_domains=False,
                dashboard=False,
            )
            self.current = await LocalCluster(cfg).__aenter__()
            self.mode = mode
        assert self.current is not None
        return self.current

    async def close(self) -> None:
        if self.current is not None:
            current, self.current, self.mode = self.current, None, ""
            await current.__aexit__(None, None, None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clusters(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Clusters]:
    c = Clusters(tmp_path_factory.mktemp("nvidiashares"))
    try:
        yield c
    finally:
        await c.close()


async def claims_in(api: client.ApiClient, ns: str) -> list[dict[str, Any]]:
    listed = await client.CustomObjectsApi(api).list_namespaced_custom_object(
        "resource.k8s.io", "v1", ns, "resourceclaims"
    )
    return list(listed.get("items") or [])


async def log_of(api: client.ApiClient, pod: dict[str, Any], container: str = "") -> str:
    core, name, ns = client.CoreV1Api(api), pod["metadata"]["name"], pod["metadata"]["namespace"]
    try:
        if container:
            return str(await core.read_namespaced_pod_log(name, ns, container=container))
        return str(await core.read_namespaced_pod_log(name, ns))
    except client.ApiException:
        return ""


async def running_pods(api: client.ApiClient, ns: str, count: int, printed: str) -> list[dict[str, Any]]:
    """The namespace's `count` running pods once each container's log has `printed`."""

    async def probe() -> list[dict[str, Any]] | None:
        pods = [p for p in await pods_in(api, ns) if running(p)]
        if len(pods) != count:
            return None
        for p in pods:
            for c in p["spec"]["containers"]:
                if printed not in await log_of(api, p, c["name"]):
                    return None
        return pods

    result: list[dict[str, Any]] = await until(probe, f"{count} pods in {ns} Running, each log with {printed!r}")
    return result


async def gpu_uuid(api: client.ApiClient, pod: dict[str, Any], container: str = "ctr") -> str:
    (device,) = edits(pod)[container]["devices"]
    return str((await device_attributes(api))[device]["uuid"])


def consumed(claim: dict[str, Any]) -> dict[str, str]:
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result.get("shareID"), result  # a share (KEP-5075), not the whole device
    return dict(result["consumedCapacity"])


async def scale(api: client.ApiClient, ns: str, name: str, replicas: int) -> None:
    """`kubectl scale deployment NAME --replicas=N`."""
    await client.AppsV1Api(api).patch_namespaced_deployment_scale(name, ns, {"spec": {"replicas": replicas}})


async def drained(api: client.ApiClient, ns: str) -> bool:
    return not await pods_in(api, ns) and not await claims_in(api, ns)


async def scale_to_zero(api: client.ApiClient, ns: str, name: str) -> None:
    await scale(api, ns, name, 0)
    await until(functools.partial(drained, api, ns), f"{ns}: pods and claims gone")


async def pending_for_capacity(api: client.ApiClient, ns: str) -> list[str]:
    """The messages of the namespace's pods that are Pending, unschedulable for capacity."""
    out = []
    for p in await pods_in(api, ns):
        cond = {c["type"]: c for c in (p.get("status") or {}).get("conditions") or []}.get("PodScheduled") or {}
        if p["status"].get("phase") == "Pending" and cond.get("reason") == "Unschedulable":
            out.append(str(cond.get("message") or ""))
    return out


async def bats_two_pods(clusters: Clusters, spec: str, prefix: str) -> tuple[list[dict[str, Any]], list[str]]:
    """bats: apply, both pods Ready within 45 s, each log has "UUID: GPU-" and the logs are equal."""
    cluster = await clusters.get("count")  # setup_file: `--set consumableShares=4` for every test
    api = await cluster.api_client()
    await apply(api, BATS / spec)
    names = [f"{prefix}-0", f"{prefix}-1"]

    async def ready() -> list[dict[str, Any]] | None:
        pods = {p["metadata"]["name"]: p for p in await pods_in(api, "default")}
        return [pods[n] for n in names] if all(n in pods and running(pods[n]) for n in names) else None

    pods: list[dict[str, Any]] = await eventually(ready, f"{names} Ready", timeout=45.0, every=0.2)

    async def logged() -> list[str] | None:
        logs = [await log_of(api, p, "ctr") for p in pods]
        return logs if all("UUID: GPU-" in text for text in logs) else None

    logs: list[str] = await eventually(logged, "both logs with UUID: GPU-", timeout=45.0, every=0.2)
    assert logs[0] == logs[1], logs  # bats: assert_equal "$uid0" "$uid1"
    return pods, logs


async def bats_delete(api: client.ApiClient, names: list[str], claim_template: str) -> None:
    """bats: `kubectl delete -f SPEC`, then each pod gone within 30 s."""
    core = client.CoreV1Api(api)
    for name in names:
        await core.delete_namespaced_pod(name, "default")
    await client.CustomObjectsApi(api).delete_namespaced_custom_object(
        "resource.k8s.io", "v1", "default", "resourceclaimtemplates", claim_template
    )

    async def gone() -> bool:
        return not ({p["metadata"]["name"] for p in await pods_in(api, "default")} & set(names))

    await eventually(gone, f"{names} deleted", timeout=30.0, every=0.2)
    await until(lambda: _no_claims(api), "the pods' claims gone")


async def _no_claims(api: client.ApiClient) -> bool:
    return not await claims_in(api, "default")


# -- --consumable-shares=4 (examples/node-config/nvidia-consumable-shares-count.yaml) ---------------------


async def test_bats_integer_shares_two_independent_pods(clusters: Clusters) -> None:
    pods, logs = await bats_two_pods(clusters, "gpu-consumable-shares-integer.yaml", "pod-share-integer")
    api = await (await clusters.get("count")).api_client()
    assert len({await gpu_uuid(api, p) for p in pods}) == 1
    assert logs[0].startswith("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-"), logs[0]
    assert [consumed(c) for c in await claims_in(api, "default")] == [{"shares": "1", "memory": "0"}] * 2
    print(f"\npod-share-integer-0 and -1 logged: {logs[0]!r}")
    await bats_delete(api, ["pod-share-integer-0", "pod-share-integer-1"], "rct-share-integer-gpu")


async def test_bats_memory_two_independent_pods_in_integer_mode(clusters: Clusters) -> None:
    pods, _ = await bats_two_pods(clusters, "gpu-consumable-shares-memory.yaml", "pod-share-memory")
    api = await (await clusters.get("count")).api_client()
    assert len({await gpu_uuid(api, p) for p in pods}) == 1
    assert [consumed(c) for c in await claims_in(api, "default")] == [{"shares": "1", "memory": "2Gi"}] * 2
    await bats_delete(api, ["pod-share-memory-0", "pod-share-memory-1"], "rct-share-memory-gpu")


async def test_bats_mps_under_consumable_shares_runs_here_where_nvidia_refuses_it(clusters: Clusters) -> None:
    """NVIDIA: pod-mps is not Ready within 15 s (MPS refused under consumable shares). Here the share is
    served by the GPU's one MPS daemon, started with the claim's MPS settings: a deliberate difference."""
    cluster = await clusters.get("count")
    api = await cluster.api_client()
    await apply(api, BATS / "gpu-mps.yaml")
    (pod,) = await running_pods(api, "default", 1, "UUID: GPU-")
    got = edits(pod)
    assert sorted(got) == ["ctr0", "ctr1"] and len({tuple(e["devices"]) for e in got.values()}) == 1, got
    (claim,) = await claims_in(api, "default")
    assert consumed(claim) == {"shares": "1", "memory": "0"}
    uuid = await gpu_uuid(api, pod, "ctr0")
    record = simulated_state_dir(cluster.node_dir(NODE)) / "mps" / share_daemon_id(uuid) / "daemon.json"
    daemon = json.loads(record.read_text())
    assert daemon["active_thread_percentage"] == 50, daemon
    assert daemon["pinned_device_memory_limits"] == {uuid: 10 * GIB}, daemon
    for e in got.values():
        env = dict(v.split("=", 1) for v in e["env"])
        # the client sees the GPU's daemon; 0 memory consumed sets no client limit (the daemon's 10Gi applies)
        assert "CUDA_MPS_PIPE_DIRECTORY" in env and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env, env
        assert any(m.startswith(f"{record.parent / 'pipe'}:") for m in e["mounts"]), e["mounts"]
    await client.CoreV1Api(api).delete_namespaced_pod("pod-mps", "default")
    await client.CustomObjectsApi(api).delete_namespaced_custom_object(
        "resource.k8s.io", "v1", "default", "resourceclaimtemplates", "rct-mps-gpu"
    )
    await until(functools.partial(drained, api, "default"), "pod-mps and its claim gone")
    await until(lambda: not record.exists(), "the GPU's MPS daemon stopped")


async def test_demo_integer_sharing_four_replicas_per_gpu(clusters: Clusters) -> None:
    cluster = await clusters.get("count")
    api = await cluster.api_client()
    ns = "gpu-share-integer"
    await apply(api, DEMO / "integer-sharing.yaml")
    pods = await running_pods(api, ns, 4, "running with 1 share claim")
    assert len({await gpu_uuid(api, p) for p in pods}) == 1, "the 4 replicas share one GPU"
    for p in pods:
        lines = (await log_of(api, p)).splitlines()
        assert (
            lines[0].startswith("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-") and lines[1] == "running with 1 share claim"
        )
    assert [consumed(c) for c in await claims_in(api, ns)] == [{"shares": "1", "memory": "0"}] * 4

    await scale(api, ns, "integer-sharing", 9)  # 2 GPUs x 4 shares: 8 fit
    pods = await running_pods(api, ns, 8, "running with 1 share claim")
    per_gpu: dict[str, int] = {}
    for p in pods:
        uuid = await gpu_uuid(api, p)
        per_gpu[uuid] = per_gpu.get(uuid, 0) + 1
    assert sorted(per_gpu.values()) == [4, 4], per_gpu
    (message,) = await until(functools.partial(pending_for_capacity, api, ns), "the ninth replica Pending")
    assert "not enough capacity" in message and "shares 0 of 4 left" in message, message
    print(f"integer-sharing at 9 replicas: {sorted(per_gpu.values())} per GPU; the ninth: {message}")
    await scale_to_zero(api, ns, "integer-sharing")


# -- --consumable-shares=memory (nvidia-consumable-shares-memory.yaml) --------------------------------------


async def test_demo_memory_sharing_4gi_replicas_share_one_gpu(clusters: Clusters) -> None:
    cluster = await clusters.get("memory")
    api = await cluster.api_client()
    ns = "gpu-share-memory"
    await apply(api, DEMO / "memory-sharing.yaml")
    pods = await running_pods(api, ns, 2, "running with 4Gi memory claim")
    assert len({await gpu_uuid(api, p) for p in pods}) == 1
    for p in pods:
        assert "(UUID: GPU-" in (await log_of(api, p)).splitlines()[0]
    assert [consumed(c) for c in await claims_in(api, ns)] == [{"memory": "4Gi"}] * 2
    await scale_to_zero(api, ns, "memory-sharing")


async def test_memory_mode_claim_naming_no_amount_takes_the_whole_gpu(clusters: Clusters) -> None:
    cluster = await clusters.get("memory")
    api = await cluster.api_client()
    ns = "gpu-share-unlimited"
    await apply(api, DEMO / "unlimited-sharing.yaml")
    pods = await running_pods(api, ns, 2, "running with unlimited sharing")
    assert len({await gpu_uuid(api, p) for p in pods}) == 2, "each claim took a whole GPU's memory"
    assert [consumed(c) for c in await claims_in(api, ns)] == [{"memory": "80Gi"}] * 2
    await scale(api, ns, "unlimited-sharing", 3)
    (message,) = await until(functools.partial(pending_for_capacity, api, ns), "the third replica Pending")
    assert "not enough capacity" in message and "memory 0 of 80Gi left" in message, message
    await scale_to_zero(api, ns, "unlimited-sharing")


# -- --consumable-shares=unlimited (nvidia-consumable-shares-unlimited.yaml) --------------------------------


async def test_demo_unlimited_sharing_any_number_on_one_gpu(clusters: Clusters) -> None:
    cluster = await clusters.get("unlimited")
    api = await cluster.api_client()
    ns = "gpu-share-unlimited"
    await apply(api, DEMO / "unlimited-sharing.yaml")
    pods = await running_pods(api, ns, 2, "running with unlimited sharing")
    assert len({await gpu_uuid(api, p) for p in pods}) == 1
    await scale(api, ns, "unlimited-sharing", 6)  # the README's `kubectl scale ... --replicas=6`
    pods = await running_pods(api, ns, 6, "running with unlimited sharing")
    assert len({await gpu_uuid(api, p) for p in pods}) == 1, "all 6 on one GPU"
    assert [consumed(c) for c in await claims_in(api, ns)] == [{"memory": "0"}] * 6
    await scale_to_zero(api, ns, "unlimited-sharing")
