"""Shares of a dynamic MIG device end to end on the local cluster (`gpu-dra up --node-config
examples/node-config/dynamic-mig-shares.yaml`, `sharing: shares`, then `mpsShares`): two tenants' claims for a
3g.40gb MIG device land on one placement, the preparer makes the MIG device once, for the first (and with
mpsShares the one MPS daemon on it, each tenant with its own limits), both pods run on it, and it is destroyed
after the last tenant leaves, not before."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path

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
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node-config" / "dynamic-mig-shares.yaml"
REQUEST = """\
        deviceClassName: mig.nvidia.com
        selectors:
        - cel: {{expression: 'device.attributes["gpu.nvidia.com"].profile == "3g.40gb"'}}
        capacity:
          requests: {{memory: 10Gi{compute}}}"""
COMPUTE = {"shares": "", "mpsShares": ", compute: 20"}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["shares", "mpsShares"])
async def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[LocalCluster, str]]:
    root = tmp_path_factory.mktemp("dynamicsharescluster")
    node_config = root / "dynamic-mig-shares.yaml"
    node_config.write_text(EXAMPLE.read_text().replace("sharing: shares", f"sharing: {request.param}"))
    async with one_gpu_cluster(root, node_config) as c:
        yield c, request.param


async def test_two_tenants_share_one_dynamic_mig_device_made_once_and_destroyed_after_the_last(
    cluster: tuple[LocalCluster, str],
) -> None:
    up, sharing = cluster
    api = await up.api_client()
    request = REQUEST.format(compute=COMPUTE[sharing])
    await asyncio.gather(*(_apply(api, tenant(ns, request)) for ns in TENANTS))
    ran = await asyncio.gather(
        *(until(functools.partial(_running_with_env, api, ns), f"{ns}/app Running") for ns in TENANTS)
    )
    results = [(await _claim(api, ns))["status"]["allocation"]["devices"]["results"][0] for ns in TENANTS]
    (device,) = {r["device"] for r in results}
    assert "-mig-3g40gb-" in device and all(r["shareID"] for r in results), results
    assert all(r["consumedCapacity"]["memory"] == "10Gi" for r in results), results
    (gpu,) = (await _inventory(up)).gpus
    (mig,) = gpu.mig_devices  # made once, for both
    assert mig.name == device
    # both containers got the MIG device's nodes, and the preparer's records name its UUID for both claims
    node_edits = [edits(pod)["ctr"] for pod, _ in ran]
    assert [e["devices"] for e in node_edits] == [[f"{NODE}/{device}"]] * 2, node_edits
    assert node_edits[0]["deviceNodes"] == node_edits[1]["deviceNodes"] and node_edits[0]["deviceNodes"]
    checkpoint = up.node_paths(NODE)["plugins"] / "gpu.nvidia.com" / "checkpoint.json"
    records = json.loads(checkpoint.read_text())["preparedClaims"].values()
    held = [d for r in records for d in r["devices"] if d["device"] == device]
    assert len(held) == 2 and all(d["dynamic_mig"] and d["uuid"] == mig.uuid for d in held), held
    if sharing == "mpsShares":  # one daemon on the MIG device, each tenant's own limits through it
        assert mig.mps_daemon and all(d["mps_daemon"] == mig.mps_daemon for d in held), (mig, held)
        for _, log in ran:
            assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20" in log and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M" in log

    await _delete(api, TENANTS[0])
    await until(functools.partial(_gone, api, TENANTS[0]), f"{TENANTS[0]} pod and claim gone")
    assert [m.uuid for m in (await _inventory(up)).gpus[0].mig_devices] == [mig.uuid]
    assert (await client.CoreV1Api(api).read_namespaced_pod("app", TENANTS[1])).status.phase == "Running"

    await _delete(api, TENANTS[1])
    await until(functools.partial(_gone, api, TENANTS[1]), f"{TENANTS[1]} pod and claim gone")

    async def destroyed() -> bool:
        gpu = (await _inventory(up)).gpus[0]
        return not gpu.mig_devices and gpu.sharing.compute_mode == "Default"

    await until(destroyed, "the MIG device destroyed after the last share")
