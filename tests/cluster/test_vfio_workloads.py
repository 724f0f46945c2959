"""NVIDIA's `gpu-test-vfiopci` workload on `gpu-dra up --passthrough`: the pod runs with the VFIO nodes in its
CDI edits, the GPU sits on vfio-pci in the node's fake sysfs meanwhile, and goes back to nvidia (and is
offered again) once the pod is gone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from embedded.cluster.local import ClusterConfig, LocalCluster
from services.preparer.pcisysfs import PciSysfs
from tests.cluster.helpers import apply, edits, wait_pods

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "workloads"
pytestmark = [pytest.mark.timeout(240)]


async def test_gpu_test_vfiopci_runs_and_gives_the_gpu_back(tmp_path: Path) -> None:
    cfg = ClusterConfig(nodes=1, gpus="h100x2", data_dir=str(tmp_path / "data"), start_timeout=120,
                        runtime="none", passthrough=True, compute_domains=False)
    async with LocalCluster(cfg) as cluster:
        api = await cluster.api_client()
        await apply(api, REFERENCE / "gpu-test-vfiopci.yaml")
        (pod,) = await wait_pods(api, "gpu-test-vfio", 1, timeout=90)
        node = pod["spec"]["nodeName"]
        sysfs = PciSysfs(cluster.node_dir(node))
        on_vfio = [b.name for b in (sysfs.sys / "bus/pci/devices").iterdir() if sysfs.driver_of(b.name) == "vfio-pci"]
        assert len(on_vfio) == 1, on_vfio
        group = sysfs.iommu_group(on_vfio[0])
        ctr = edits(pod)["ctr"]
        assert ctr["deviceNodes"] == [f"/dev/vfio/{group}"], ctr
        assert "NVIDIA_VISIBLE_DEVICES=void" in ctr["env"]

        await client.CoreV1Api(api).delete_namespaced_pod("pod1", "gpu-test-vfio", grace_period_seconds=0)
        async with asyncio.timeout(60):
            while sysfs.driver_of(on_vfio[0]) != "nvidia":
                await asyncio.sleep(0.1)
        assert (sysfs.device_dir(on_vfio[0]) / "driver_override").read_text().strip() == ""
        slices = await client.CustomObjectsApi(api).list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices")
        offered = {d["name"] for s in slices["items"] for d in s["spec"].get("devices") or []}
        assert {"gpu-0", "gpu-1", "gpu-vfio-0", "gpu-vfio-1"} <= offered
