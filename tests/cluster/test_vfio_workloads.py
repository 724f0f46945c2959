"""NVIDIA's `gpu-test-vfiopci` and `gpu-test-vfio-config` workloads on `gpu-dra up --passthrough`: the pod runs
with the VFIO nodes in its CDI edits, the GPU sits on vfio-pci in the node's fake sysfs meanwhile, and goes
back to nvidia (and is offered again) once the pod is gone. Both tests run on one cluster: each gives its GPU back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from embedded.cluster.apply import Applier, ManifestError, load_documents
from embedded.cluster.local import ClusterConfig, LocalCluster
from services.preparer.gpu.pcisysfs import PciSysfs
from tests.cluster.helpers import apply, edits, wait_pods

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "workloads"
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]
NODE = "gpu-node-0"
NAMESPACES = ("gpu-test-vfio", "gpu-test-vfiopci")  # the pods' namespaces of both specs


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    cfg = ClusterConfig(
        nodes=1,
        gpus="h100x2",
        data_dir=str(tmp_path_factory.mktemp("vfio") / "data"),
        start_timeout=120,
        runtime="none",
        passthrough=True,
        compute_domains=False,
        dashboard=False,
    )
    async with LocalCluster(cfg) as cluster:
        yield cluster


@pytest_asyncio.fixture(loop_scope="module")
async def passthrough_cluster(shared_cluster: LocalCluster) -> AsyncIterator[LocalCluster]:
    """The shared cluster with both GPUs on nvidia; after the test, a pod it left is deleted and its GPU given
    back (a passing test has done both already)."""
    sysfs = PciSysfs(shared_cluster.node_dir(NODE))
    assert on_vfio(sysfs) == [], "a GPU is still on vfio-pci"
    yield shared_cluster
    api = await shared_cluster.api_client()
    core = client.CoreV1Api(api)
    for ns in NAMESPACES:
        for pod in (await core.list_namespaced_pod(ns)).items if await _exists(core, ns) else []:
            await core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)
    await given_back(sysfs, on_vfio(sysfs))


async def _exists(core: client.CoreV1Api, namespace: str) -> bool:
    return namespace in {ns.metadata.name for ns in (await core.list_namespace()).items}


def on_vfio(sysfs: PciSysfs) -> list[str]:
    return [b.name for b in (sysfs.sys / "bus/pci/devices").iterdir() if sysfs.driver_of(b.name) == "vfio-pci"]


async def given_back(sysfs: PciSysfs, bdfs: list[str], timeout: float = 60) -> None:
    """Until each of `bdfs` is back on nvidia with `driver_override` cleared, the release's last step (sysfs has
    no change notification)."""

    def released(bdf: str) -> bool:
        return (
            sysfs.driver_of(bdf) == "nvidia" and (sysfs.device_dir(bdf) / "driver_override").read_text().strip() == ""
        )

    try:
        async with asyncio.timeout(timeout):
            while not all(released(bdf) for bdf in bdfs):
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(
            "not given back: "
            + ", ".join(
                f"{b} on {sysfs.driver_of(b)!r}, override {(sysfs.device_dir(b) / 'driver_override').read_text()!r}"
                for b in bdfs
            )
        ) from None


async def test_gpu_test_vfiopci_runs_and_gives_the_gpu_back(passthrough_cluster: LocalCluster) -> None:
    cluster = passthrough_cluster
    api = await cluster.api_client()
    await apply(api, REFERENCE / "gpu-test-vfiopci.yaml")
    (pod,) = await wait_pods(api, "gpu-test-vfio", 1, timeout=90)
    await check_passthrough(api, cluster, pod, api_device=False)


async def test_gpu_test_vfio_config_runs_with_the_api_device(passthrough_cluster: LocalCluster) -> None:
    """NVIDIA's spec puts its template in namespace gpu-test-vfio and its pod in gpu-test-vfiopci (whose
    namespace it does not create), so applied as it is the pod cannot be created, and once its namespace
    exists it waits for a template that is not in its namespace. Applied as a CI run would make it work:
    the pod's namespace first, the spec, then the spec's template copied into the pod's namespace."""
    cluster = passthrough_cluster
    api = await cluster.api_client()
    with pytest.raises(ManifestError, match=r"namespaces .*gpu-test-vfiopci.* not found"):
        await apply(api, REFERENCE / "gpu-test-vfio-config.yaml")
    applier = Applier(api)
    await applier.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpu-test-vfiopci"}})
    await apply(api, REFERENCE / "gpu-test-vfio-config.yaml")
    (template,) = [
        d for d in load_documents(REFERENCE / "gpu-test-vfio-config.yaml") if d["kind"] == "ResourceClaimTemplate"
    ]
    assert template["metadata"]["namespace"] == "gpu-test-vfio"
    await applier.create({**template, "metadata": {**template["metadata"], "namespace": "gpu-test-vfiopci"}})
    (pod,) = await wait_pods(api, "gpu-test-vfiopci", 1, timeout=90)
    await check_passthrough(api, cluster, pod, api_device=True)


async def check_passthrough(
    api: client.ApiClient, cluster: LocalCluster, pod: dict[str, Any], *, api_device: bool
) -> None:
    """The pod's one GPU on vfio-pci with its group's node (and /dev/vfio/vfio with `api_device`) in the CDI
    edits; after the pod is deleted, back on nvidia and offered both ways again."""
    node = pod["spec"]["nodeName"]
    sysfs = PciSysfs(cluster.node_dir(node))
    moved = on_vfio(sysfs)
    assert len(moved) == 1, moved
    group = sysfs.iommu_group(moved[0])
    ctr = edits(pod)["ctr"]
    assert ctr["deviceNodes"] == [*(["/dev/vfio/vfio"] if api_device else []), f"/dev/vfio/{group}"], ctr
    assert "NVIDIA_VISIBLE_DEVICES=void" in ctr["env"]

    meta = pod["metadata"]
    await client.CoreV1Api(api).delete_namespaced_pod(meta["name"], meta["namespace"], grace_period_seconds=0)
    await given_back(sysfs, moved)  # on nvidia, then driver_override cleared: waits for both
    assert sysfs.driver_of(moved[0]) == "nvidia"
    assert (sysfs.device_dir(moved[0]) / "driver_override").read_text().strip() == ""
    slices = await client.CustomObjectsApi(api).list_cluster_custom_object("resource.k8s.io", "v1", "resourceslices")
    offered = {d["name"] for s in slices["items"] for d in s["spec"].get("devices") or []}
    assert {"gpu-0", "gpu-1", "gpu-vfio-0", "gpu-vfio-1"} <= offered
