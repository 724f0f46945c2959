"""Shares of a dynamic MIG device end to end on the local cluster (`gpu-dra up --node-config` with a rule
`sharing: shares, mig: dynamic`): two tenants' claims for a 3g.40gb MIG device land on one placement, the
preparer makes the MIG device once, for the first, both pods run on its UUID, and it is destroyed after the
last tenant leaves, not before."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from embedded.cluster.local import LocalCluster
from tests.cluster.helpers import edits
from tests.cluster.test_shares_e2e import (
    NODE,
    _apply,
    _claim,
    _delete,
    _gone,
    _inventory,
    _running_with_env,
    one_gpu_cluster,
    tenant,
    until,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]
TENANTS = ["tenant-a", "tenant-b"]
NODE_CONFIG = """\
apiVersion: resource.nvidia.com/v1beta1
kind: NodeConfig
metadata: {name: dynamic-mig-shares}
spec:
  rules:
  - name: every-gpu-dynamic-shares
    sharing: shares
    mig: dynamic
    memoryStep: 5Gi
"""
REQUEST = """\
        deviceClassName: mig.nvidia.com
        selectors:
        - cel: {expression: 'device.attributes["gpu.nvidia.com"].profile == "3g.40gb"'}
        capacity:
          requests: {memory: 10Gi}"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    root = tmp_path_factory.mktemp("dynamicsharescluster")
    node_config = root / "dynamic-mig-shares.yaml"
    node_config.write_text(NODE_CONFIG)
    async with one_gpu_cluster(root, node_config) as c:
        yield c


async def test_two_tenants_share_one_dynamic_mig_device_made_once_and_destroyed_after_the_last(
    cluster: LocalCluster,
) -> None:
    api = await cluster.api_client()
    await asyncio.gather(*(_apply(api, tenant(ns, REQUEST)) for ns in TENANTS))
    ran = await asyncio.gather(
        *(until(functools.partial(_running_with_env, api, ns), f"{ns}/app Running") for ns in TENANTS)
    )
    results = [(await _claim(api, ns))["status"]["allocation"]["devices"]["results"][0] for ns in TENANTS]
    (device,) = {r["device"] for r in results}
    assert "-mig-3g40gb-" in device and all(r["shareID"] for r in results), results
    assert all(r["consumedCapacity"]["memory"] == "10Gi" for r in results), results
    (gpu,) = (await _inventory(cluster)).gpus
    (mig,) = gpu.mig_devices  # made once, for both
    assert mig.name == device
    # both containers got the MIG device's nodes, and the preparer's records name its UUID for both claims
    node_edits = [edits(pod)["ctr"] for pod, _ in ran]
    assert [e["devices"] for e in node_edits] == [[f"{NODE}/{device}"]] * 2, node_edits
    assert node_edits[0]["deviceNodes"] == node_edits[1]["deviceNodes"] and node_edits[0]["deviceNodes"]
    checkpoint = cluster.node_paths(NODE)["plugins"] / "gpu.nvidia.com" / "checkpoint.json"
    records = json.loads(checkpoint.read_text())["preparedClaims"].values()
    held = [d for r in records for d in r["devices"] if d["device"] == device]
    assert len(held) == 2 and all(d["dynamic_mig"] and d["uuid"] == mig.uuid for d in held), held

    await _delete(api, TENANTS[0])
    await until(functools.partial(_gone, api, TENANTS[0]), f"{TENANTS[0]} pod and claim gone")
    assert [m.uuid for m in (await _inventory(cluster)).gpus[0].mig_devices] == [mig.uuid]
    assert (await client.CoreV1Api(api).read_namespaced_pod("app", TENANTS[1])).status.phase == "Running"

    await _delete(api, TENANTS[1])
    await until(functools.partial(_gone, api, TENANTS[1]), f"{TENANTS[1]} pod and claim gone")

    async def destroyed() -> bool:
        return not (await _inventory(cluster)).gpus[0].mig_devices

    await until(destroyed, "the MIG device destroyed after the last share")
