"""Shares of one GPU end to end on the local cluster (`gpu-dra up --node-config examples/node-config/mps-shares.yaml`):
one node with one 80 GiB H100 in MPS shares of 10 GiB memory and 10% compute. Eight tenants, each in its own
namespace with a claim asking for 10Gi, run together on that GPU, each container seeing its own MPS client
limits; a ninth stays Pending for capacity. Seven leave and the eighth keeps running on the GPU's one MPS
daemon; the last leaving stops the daemon within 2 s."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio import client

from embedded.cluster.apply import Applier
from embedded.cluster.local import ClusterConfig, LocalCluster
from services.discovery.config import simulated_state_dir
from shared.claimconfigs import share_daemon_id
from shared.events import catalog
from shared.events.inventory import NodeInventory
from tests.cluster.helpers import device_attributes, edits
from tests.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node-config" / "mps-shares.yaml"
NODE = "gpu-node-0"
TENANTS = [f"tenant-{i}" for i in range(8)]
COMPUTE = {ns: 30 if ns == TENANTS[-1] else 10 for ns in TENANTS}  # 7 x 10% + 30%: all of the SMs
GIB = 1 << 30
TENANT = """\
apiVersion: v1
kind: Namespace
metadata: {{name: {ns}}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: share, namespace: {ns}}}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
{request}
---
apiVersion: v1
kind: Pod
metadata: {{name: app, namespace: {ns}}}
spec:
  terminationGracePeriodSeconds: 5
  containers:
  - name: ctr
    image: ubuntu:22.04
    command: [sh, -c, "env | grep -E '^(NVIDIA|CUDA)_' | sort; echo started; trap 'exit 0' TERM; sleep 600 & wait"]
    resources: {{claims: [{{name: gpu}}]}}
  resourceClaims:
  - {{name: gpu, resourceClaimName: share}}
"""

until = functools.partial(eventually, timeout=90.0, every=0.2)


def tenant(ns: str, request: str) -> str:
    """A tenant's namespace, its claim `share` with `request` (the lines under `exactly:`) and its pod `app`."""
    return TENANT.format(ns=ns, request=request)


def mps_tenant(ns: str, compute: int) -> str:
    """A tenant asking an MPS share of 10Gi and `compute` percent."""
    capacity = f'{{memory: 10Gi, compute: "{compute}"}}'
    return tenant(ns, f"        deviceClassName: gpu.nvidia.com\n        capacity:\n          requests: {capacity}")


@contextlib.asynccontextmanager
async def one_gpu_cluster(root: Path, node_config: Path) -> AsyncIterator[LocalCluster]:
    """`gpu-dra up` with one node of one H100 under `node_config`, without ComputeDomains or the dashboard."""
    cfg = ClusterConfig(
        nodes=1,
        gpus="h100x1",
        node_config=str(node_config),
        data_dir=str(root / "data"),
        start_timeout=120,
        compute_domains=False,
        dashboard=False,
    )
    async with LocalCluster(cfg) as c:
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    async with one_gpu_cluster(tmp_path_factory.mktemp("sharescluster"), EXAMPLE) as c:
        yield c


async def _apply(api: client.ApiClient, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        await Applier(api).apply_file(Path(f.name))


async def _pod(api: client.ApiClient, ns: str) -> dict[str, Any]:
    return dict(api.sanitize_for_serialization(await client.CoreV1Api(api).read_namespaced_pod("app", ns)))


async def _claim(api: client.ApiClient, ns: str) -> dict[str, Any]:
    return dict(
        await client.CustomObjectsApi(api).get_namespaced_custom_object(
            "resource.k8s.io", "v1", ns, "resourceclaims", "share"
        )
    )


async def _running_with_env(api: client.ApiClient, ns: str) -> tuple[dict[str, Any], str] | None:
    pod = await _pod(api, ns)
    if (pod.get("status") or {}).get("phase") != "Running":
        return None
    try:
        text = str(await client.CoreV1Api(api).read_namespaced_pod_log("app", ns))
    except client.ApiException:
        return None
    return (pod, text) if "started" in text else None


async def _inventory(cluster: LocalCluster) -> NodeInventory:
    assert cluster.bus is not None
    inv = await (await cluster.bus.kv(catalog.INVENTORY_BUCKET)).get(NODE)
    assert isinstance(inv, NodeInventory)
    return inv


def _daemon_record(cluster: LocalCluster, daemon: str) -> Path:
    return simulated_state_dir(cluster.node_dir(NODE)) / "mps" / daemon / "daemon.json"  # discovery's record


async def _delete(api: client.ApiClient, ns: str) -> None:
    await client.CoreV1Api(api).delete_namespaced_pod("app", ns)
    await client.CustomObjectsApi(api).delete_namespaced_custom_object(
        "resource.k8s.io", "v1", ns, "resourceclaims", "share"
    )


async def _gone(api: client.ApiClient, ns: str) -> bool:
    """The tenant's pod and claim are both gone."""
    for read in (_pod, _claim):
        try:
            await read(api, ns)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        else:
            return False
    return True


async def _explain(cluster: LocalCluster, node: str) -> subprocess.CompletedProcess[str]:
    """`gpu-dra nodeconfig explain NODE` against the cluster: its objects and Node from the API server, the
    node's GPUs from NATS (the data dir's nats.json), as an operator runs it."""
    cmd = [sys.executable, "-m", "shared.cli", "nodeconfig", "explain", node]
    cmd += ["--kubeconfig", str(cluster.kubeconfig_path), "--data-dir", str(cluster.data_dir)]
    return await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=60)


async def test_eight_tenants_share_one_gpu_through_one_mps_daemon(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    explained = await _explain(cluster, NODE)
    assert explained.returncode == 0, explained.stderr
    assert re.search(
        r"gpu-0 \(NVIDIA H100[^)]*\): sharing=mpsShares memoryStep=10240Mi memoryDefault=step computeStep=10% .*"
        r"<- rule 'mps-shares/every-gpu-mps'",
        explained.stdout,
    ), explained.stdout
    unknown = await _explain(cluster, "no-such-node")
    assert unknown.returncode == 2 and "no-such-node" in unknown.stderr, unknown
    started = time.monotonic()
    await asyncio.gather(*(_apply(api, mps_tenant(ns, COMPUTE[ns])) for ns in TENANTS))
    ran = await asyncio.gather(
        *(until(functools.partial(_running_with_env, api, ns), f"{ns}/app Running") for ns in TENANTS)
    )
    took = time.monotonic() - started
    attrs = await device_attributes(api)
    uuids: set[str] = set()
    daemons: set[str] = set()
    for ns, (pod, text) in zip(TENANTS, ran, strict=True):
        env = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        (device,) = edits(pod)["ctr"]["devices"]
        uuids.add(attrs[device]["uuid"])
        assert env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == str(COMPUTE[ns]), (ns, text)
        assert re.fullmatch(r"0=10240M", env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")), (ns, text)
        pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
        daemons.update(
            host for host, _, path in (m.partition(":") for m in edits(pod)["ctr"]["mounts"]) if path == pipe
        )
        (result,) = (await _claim(api, ns))["status"]["allocation"]["devices"]["results"]
        assert result["shareID"] and result["consumedCapacity"] == {"memory": "10Gi", "compute": str(COMPUTE[ns])}, (
            result
        )
    (gpu,) = uuids
    daemon = share_daemon_id(gpu)
    assert daemons == {str(_daemon_record(cluster, daemon).parent / "pipe")}, daemons
    inv = await _inventory(cluster)
    assert [g.sharing.mps_daemon for g in inv.gpus if g.uuid == gpu] == [daemon]
    assert _daemon_record(cluster, daemon).exists()
    print(f"\n8 tenants Running on {gpu} in {took:.1f}s; {TENANTS[0]}'s log:\n{ran[0][1]}")

    # a ninth: the GPU's 80Gi are taken
    await _apply(api, mps_tenant("tenant-8", 10))

    async def unschedulable() -> str | None:
        cond = {c["type"]: c for c in (await _pod(api, "tenant-8")).get("status", {}).get("conditions") or []}
        msg = str(cond.get("PodScheduled", {}).get("message") or "")
        return msg if cond.get("PodScheduled", {}).get("reason") == "Unschedulable" else None

    message = await until(unschedulable, "tenant-8 unschedulable")
    assert "not enough capacity" in message, message
    assert "memory 0 of 80Gi left" in message and "compute 0 of 100 left" in message, message
    assert (await _pod(api, "tenant-8"))["status"]["phase"] == "Pending"

    async def failed_scheduling() -> list[str]:
        events = await client.CoreV1Api(api).list_namespaced_event("tenant-8", field_selector="reason=FailedScheduling")
        return [e.message for e in events.items if "not enough capacity" in (e.message or "")]

    await until(failed_scheduling, "a FailedScheduling event naming capacity")
    print(f"tenant-8: {message}")
    await _delete(api, "tenant-8")

    # seven leave; the eighth keeps running on the daemon
    await asyncio.gather(*(_delete(api, ns) for ns in TENANTS[:7]))
    await asyncio.gather(*(until(functools.partial(_gone, api, ns), f"{ns} pod and claim gone") for ns in TENANTS[:7]))
    last = await _pod(api, TENANTS[7])
    assert last["status"]["phase"] == "Running", last["status"]
    assert _daemon_record(cluster, daemon).exists()
    inv = await _inventory(cluster)
    assert [g.sharing.mps_daemon for g in inv.gpus if g.uuid == gpu] == [daemon]

    # the node config turns every GPU exclusive: the slices follow at once, the share in use and its daemon stay
    (allocated,) = (await _claim(api, TENANTS[7]))["status"]["allocation"]["devices"]["results"]
    exclusive = yaml.safe_load(EXAMPLE.read_text())
    exclusive["spec"]["rules"] = [{"name": "every-gpu-whole", "sharing": "exclusive"}]
    await Applier(api).create_or_replace(exclusive)

    async def offered_whole() -> bool:
        listed = await client.CustomObjectsApi(api).list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={NODE}"
        )
        devices = [d for item in listed["items"] for d in item["spec"].get("devices") or []]
        return bool(devices) and not any(d.get("allowMultipleAllocations") for d in devices)

    await until(offered_whole, "the node's devices offered whole")
    explained = await _explain(cluster, NODE)
    assert "gpu-0 (NVIDIA H100" in explained.stdout and "sharing=exclusive" in explained.stdout, explained
    assert "<- rule 'mps-shares/every-gpu-whole'" in explained.stdout, explained.stdout
    assert (await _claim(api, TENANTS[7]))["status"]["allocation"]["devices"]["results"] == [allocated]
    assert (await _pod(api, TENANTS[7]))["status"]["phase"] == "Running"
    assert _daemon_record(cluster, daemon).exists()
    inv = await _inventory(cluster)
    assert [g.sharing.mps_daemon for g in inv.gpus if g.uuid == gpu] == [daemon]

    # the last leaves: its pod and claim deleted, the daemon stops within 2 s
    stopping = time.monotonic()
    await _delete(api, TENANTS[7])

    async def daemon_stopped() -> bool:
        inv = await _inventory(cluster)
        return not _daemon_record(cluster, daemon).exists() and all(g.sharing.mps_daemon == "" for g in inv.gpus)

    await eventually(daemon_stopped, "the MPS daemon stopped", timeout=2.0, every=0.05)
    print(f"daemon stopped {time.monotonic() - stopping:.2f}s after the last pod and claim were deleted")
    await until(functools.partial(_gone, api, TENANTS[7]), "the last pod and claim gone")
