"""KEP-4680 end to end on a local cluster: an XID 79 injected through discovery taints the pod's GPU, the preparer's
health stream says Unhealthy, and the kubelet emulator writes it into the container's `allocatedResourcesStatus`
as kubelet 1.34 does (`claim:<pod claim name>/<request>`, the device's CDI id, Healthy before)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from embedded.cluster.local import ClusterConfig, LocalCluster
from tests.cluster.helpers import apply, edits, gpu_pod_manifest, inject_xid
from tests.polling import eventually

pytestmark = [pytest.mark.timeout(240)]


def health_of(pod: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {c["name"]: c.get("allocatedResourcesStatus") or [] for c in pod["status"].get("containerStatuses") or []}


async def test_an_xid_79_shows_in_the_pods_allocated_resources_status(tmp_path: Path) -> None:
    cfg = ClusterConfig(
        nodes=1,
        gpus="h100x2",
        data_dir=str(tmp_path / "data"),
        start_timeout=120,
        compute_domains=False,
        dashboard=False,
    )
    async with LocalCluster(cfg) as cluster:
        api = await cluster.api_client()
        spec = tmp_path / "worker.yaml"
        spec.write_text(gpu_pod_manifest("health", "worker"))
        await apply(api, spec)
        core = client.CoreV1Api(api)

        async def pod_with(health: str) -> dict[str, Any] | None:
            pod = dict(api.sanitize_for_serialization(await core.read_namespaced_pod("worker", "health")))
            statuses = health_of(pod).get("ctr") or []
            return pod if any(r["health"] == health for s in statuses for r in s["resources"]) else None

        wait = functools.partial(eventually, timeout=90.0, every=0.2)
        pod = await wait(lambda: pod_with("Healthy"), "the pod's GPU reported Healthy")
        (device,) = edits(pod)["ctr"]["devices"]
        (cdi_id,) = edits(pod)["ctr"]["cdiDevices"][:1]
        assert health_of(pod) == {
            "ctr": [{"name": "claim:gpus/gpu", "resources": [{"resourceID": cdi_id, "health": "Healthy"}]}],
            "side": [],
        }

        await inject_xid(cluster.nats_env(), "gpu-node-0", device.split("/")[1], 79)

        pod = await wait(lambda: pod_with("Unhealthy"), "the pod's GPU reported Unhealthy")
        assert health_of(pod)["ctr"] == [
            {"name": "claim:gpus/gpu", "resources": [{"resourceID": cdi_id, "health": "Unhealthy"}]}
        ]
        assert pod["status"]["phase"] == "Running"  # the status write kept the rest of the container statuses
        assert all(c["state"].get("running") for c in pod["status"]["containerStatuses"])

        async def taints() -> list[dict[str, Any]]:
            slices = await client.CustomObjectsApi(api).list_cluster_custom_object(
                "resource.k8s.io", "v1", "resourceslices"
            )
            return [
                t
                for s in slices["items"]
                for d in s["spec"].get("devices") or []
                if f"{s['spec']['pool']['name']}/{d['name']}" == device
                for t in d.get("taints") or []
            ]

        assert await wait(taints, "the device tainted in its slice")
