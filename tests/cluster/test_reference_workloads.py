"""The reference workloads (all but VFIO and IMEX) run on a local cluster as their comments say.

One cluster for the module: 2 simulated nodes, each with 4 H100s and 2 MIG-partitioned A100s, every
service its own process. Manifests come from tests/fixtures/reference/workloads (NVIDIA's quickstart workloads, copied
into the repo); each test applies one and checks what the kubelet emulator recorded for every container.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from embedded.cluster.local import ClusterConfig, LocalCluster
from tests.cluster.helpers import (
    MIG_MACHINE,
    apply,
    checkpoint_text,
    device_attributes,
    edits,
    pods_in,
    wait_pods,
)

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "workloads"
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    root = tmp_path_factory.mktemp("refcluster")
    machine = root / "machine.yaml"
    machine.write_text(MIG_MACHINE)
    # What the emulator records, not what runs: the images' own binaries (cuda-sample's /tmp/sample) are not here.
    cfg = ClusterConfig(nodes=2, machine=str(machine), data_dir=str(root / "data"), start_timeout=120, runtime="none")
    async with LocalCluster(cfg) as c:
        yield c


def gpu_devices(pod: dict, container: str) -> list[str]:
    return list(edits(pod)[container]["devices"])


async def test_gpu_test1_two_pods_get_distinct_gpus(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    await apply(api, REFERENCE / "gpu-test1.yaml")
    pods = await wait_pods(api, "gpu-test1", 2)
    got = [gpu_devices(p, "ctr") for p in pods]
    assert all(len(d) == 1 for d in got), got
    assert got[0] != got[1], "each pod has its own GPU"
    for p in pods:
        env = edits(p)["ctr"]["env"]
        assert (
            any(e.startswith("NVIDIA_VISIBLE_DEVICES=") or "UUID" in e for e in env) or edits(p)["ctr"]["deviceNodes"]
        )


async def test_gpu_test2_two_containers_share_one_gpu(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    await apply(api, REFERENCE / "gpu-test2.yaml")
    (pod,) = await wait_pods(api, "gpu-test2", 1)
    per_container = {c: tuple(e["devices"]) for c, e in edits(pod).items()}
    assert len(per_container) == 2 and len(set(per_container.values())) == 1, per_container


async def test_gpu_test3_one_global_claim_shared_by_two_pods(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    await apply(api, REFERENCE / "gpu-test3.yaml")
    pods = await wait_pods(api, "gpu-test3", 2)
    assert len({tuple(gpu_devices(p, "ctr")) for p in pods}) == 1
    assert len({p["spec"]["nodeName"] for p in pods}) == 1
    claims = await client.CustomObjectsApi(api).list_namespaced_custom_object(
        "resource.k8s.io", "v1", "gpu-test3", "resourceclaims"
    )
    (claim,) = claims["items"]
    assert {r["name"] for r in claim["status"]["reservedFor"]} == {p["metadata"]["name"] for p in pods}


async def test_gpu_test4_mig_devices_of_one_parent_per_pod(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    await apply(api, REFERENCE / "gpu-test4.yaml")
    pods = await wait_pods(api, "gpu-test4", 4, timeout=90)
    attrs = await device_attributes(api)
    parents_seen = set()
    for pod in pods:
        got = edits(pod)
        assert sorted(got) == ["ctr0", "ctr1", "ctr2", "ctr3"]
        devices = [d for c in sorted(got) for d in got[c]["devices"]]
        assert len(set(devices)) == 4, "four distinct MIG devices"
        profiles = sorted(attrs[d]["profile"] for d in devices)
        assert profiles == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
        parents = {attrs[d]["parentUUID"] for d in devices}
        assert len(parents) == 1, "matchAttribute parentUUID: one parent GPU"
        parents_seen |= parents
    assert len(parents_seen) == 4, "each replica on its own A100"


async def test_gpu_test5_time_slicing_and_mps_configs_reach_the_preparer(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    await apply(api, REFERENCE / "gpu-test5.yaml")
    (pod,) = await wait_pods(api, "gpu-test5", 1)
    got = edits(pod)
    mps = [c for c, e in got.items() if any(v.startswith("CUDA_MPS_PIPE_DIRECTORY=") for v in e["env"])]
    assert mps, f"an MPS container gets the MPS pipe directory: {got}"
    node_dir = cluster.node_dir(pod["spec"]["nodeName"])
    assert "TimeSlicing" in checkpoint_text(node_dir), "the time-slicing config was applied by the preparer"


async def test_gpu_test_mps_two_containers_share_one_mps_gpu(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    await apply(api, REFERENCE / "gpu-test-mps.yaml")
    (pod,) = await wait_pods(api, "gpu-test-mps", 1)
    got = edits(pod)
    assert len(got) == 2 and len({tuple(e["devices"]) for e in got.values()}) == 1
    for e in got.values():
        assert any(v.startswith("CUDA_MPS_PIPE_DIRECTORY=") for v in e["env"])
        assert any(m.endswith(":/dev/shm") for m in e["mounts"]), e["mounts"]


async def test_gpu_test6_removed_index_attribute_stays_pending_with_an_explanation(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    await apply(api, REFERENCE / "gpu-test6.yaml")
    pods = await wait_pods(api, "gpu-test6", 4, ready=False)

    async def explained() -> bool:
        for p in await pods_in(api, "gpu-test6"):
            cond = {c["type"]: c for c in (p.get("status") or {}).get("conditions") or []}.get("PodScheduled")
            message = (cond or {}).get("message", "")
            # No MIG-disabled A100 here, so the selector fails on productName before it reaches `index`.
            if not cond or cond["status"] != "False" or not ("index" in message or "selector" in message):
                return False
        return True

    assert cluster.supervisor is not None
    await cluster.supervisor.wait_until("gpu-test6 explained", explained, timeout=60)
    assert all(not p["spec"].get("nodeName") for p in await pods_in(api, "gpu-test6"))
    assert pods
