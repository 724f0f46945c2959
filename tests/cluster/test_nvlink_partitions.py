"""NVLink partitions on `gpu-dra up --gpus h100x8 --nvlink-partitions`: two pods whose claims matchAttribute on
`gpu.nvidia.com/partition2` (examples/nvlink-partitions/pairs.yaml) each get the two GPUs of one 2-GPU partition,
the simulated Fabric Manager has exactly those two partitions active while they run, and none once they are gone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_asyncio import client

from embedded.cluster.local import ClusterConfig, LocalCluster
from services.discovery.config import simulated_state_dir
from services.discovery.simfabric import state_file
from tests.cluster.helpers import apply, device_attributes, edits, wait_pods

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nvlink-partitions" / "pairs.yaml"
NAMESPACE = "demo-nvlink-partition"
pytestmark = [pytest.mark.timeout(240)]


def active(node_dir: Path, node: str) -> dict[int, list[int]]:
    """The simulated Fabric Manager's active partitions: id -> module ids."""
    table = json.loads(state_file(simulated_state_dir(node_dir), node).read_text())
    return {
        p["partitionId"]: sorted(g["physicalId"] for g in p["gpuInfo"]) for p in table["partitionInfo"] if p["isActive"]
    }


def test_the_example_is_valid() -> None:
    for doc in yaml.safe_load_all(EXAMPLE.read_text()):
        kubernetes_validate.validate(doc, "1.34.0", strict=True)


async def test_claims_matching_on_partition2_get_one_partition_each_and_it_is_deactivated_after(tmp_path: Path) -> None:
    cfg = ClusterConfig(
        nodes=1,
        gpus="h100x8",
        data_dir=str(tmp_path / "data"),
        start_timeout=120,
        runtime="none",
        compute_domains=False,
        nvlink_partitions=True,
    )
    async with LocalCluster(cfg) as cluster:
        api = await cluster.api_client()
        await apply(api, EXAMPLE)
        pods = await wait_pods(api, NAMESPACE, 2, timeout=90)
        node = pods[0]["spec"]["nodeName"]
        attrs = await device_attributes(api)
        held = []
        for pod in pods:
            devices = [d.split("/", 1)[1] if "/" in d else d for d in edits(pod)["ctr"]["devices"]]
            assert len(devices) == 2, devices
            partitions = {attrs[f"{node}/{d}"]["partition2"] for d in devices}
            assert len(partitions) == 1, (devices, partitions)
            held.append((partitions.pop(), sorted(attrs[f"{node}/{d}"]["gpuModuleID"] for d in devices)))
        assert active(cluster.node_dir(node), node) == dict(held)

        for pod in pods:
            await client.CoreV1Api(api).delete_namespaced_pod(
                pod["metadata"]["name"], NAMESPACE, grace_period_seconds=0
            )
        async with asyncio.timeout(60):
            while active(cluster.node_dir(node), node):  # the simulated FM's file: another process's effect
                await asyncio.sleep(0.1)
