"""ComputeDomains end to end on a local cluster: 4 GB200 nodes in two NVLink cliques, every service
its own process (controller, agents with simulated IMEX daemons over loopback TCP, preparers with
both drivers, kubelet emulators, scheduler, controllers).

A 4-node domain with a 4-pod Deployment: the scheduler spreads the pods (one channel-0 per node),
each pod gets the IMEX channel device, the domain turns Ready with every node's clique and index in
its status; deleting the workload and the domain leaves no daemon, claim, template or KV entry.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from embedded.cluster.local import ClusterConfig, LocalCluster
from services.computedomain.membership import Membership
from shared.kube.rest import get_json
from tests.cluster.helpers import edits, pods_in, wait_pods
from tests.computedomain.helpers import wait_for_object

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]

GROUP, VERSION, PLURAL = "resource.nvidia.com", "v1beta1", "computedomains"
NS = "cd-e2e"
CLIQUES = "gb200x4:clique=1;gb200x4:clique=1;gb200x4:clique=2;gb200x4:clique=2"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    root = tmp_path_factory.mktemp("cdcluster")
    cfg = ClusterConfig(nodes=4, gpus=CLIQUES, data_dir=str(root / "data"), start_timeout=120)
    async with LocalCluster(cfg) as c:
        yield c


def compute_domain(name: str, template: str, num_nodes: int = 0) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": template}}},
    }


def workload(name: str, template: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {"name": "ctr", "image": "ubuntu:22.04", "resources": {"claims": [{"name": "channel"}]}}
                    ],
                    "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": template}],
                },
            },
        },
    }


def imex_daemons(cluster: LocalCluster) -> list[str]:
    """IMEX daemon processes of this cluster (their config files live under its socket root)."""
    found = subprocess.run(["pgrep", "-af", f"{cluster.socket_root}.*imex"], capture_output=True, text=True)
    return [
        line
        for line in found.stdout.splitlines()
        if "computedomain agent" not in line and not line.split(maxsplit=2)[1].endswith("bwrap")
    ]  # a sandboxed container is not a daemon


async def _domain_events(api: Any, uid: str, reason: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The controller's Events about the ComputeDomain `uid` with `reason`, once there is one (the Event
    is recorded right after the status it reports; no watch on Events for one line)."""
    deadline = asyncio.get_running_loop().time() + timeout
    delay = 0.05
    while True:
        listed = await get_json(api, f"/api/v1/namespaces/{NS}/events")
        found = [e for e in listed["items"] if e["involvedObject"].get("uid") == uid and e["reason"] == reason]
        if found or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


async def test_a_four_node_domain_across_two_cliques_runs_its_workload_and_leaves_nothing(
    cluster: LocalCluster,
) -> None:
    api = await cluster.api_client()
    core, custom, apps = client.CoreV1Api(api), client.CustomObjectsApi(api), client.AppsV1Api(api)
    await core.create_namespace({"metadata": {"name": NS}})  # type: ignore[arg-type]  # the client sends a dict as it is
    await custom.create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, compute_domain("train", "train-channel", 4)
    )
    # the controller writes the workload's claim template
    await wait_for_object(
        custom,
        "resource.k8s.io",
        "v1",
        NS,
        "resourceclaimtemplates",
        "train-channel",
        lambda obj: obj is not None,
        timeout=30,
    )
    await apps.create_namespaced_deployment(NS, workload("trainer", "train-channel", 4))  # type: ignore[arg-type]  # the client sends a dict as it is

    pods = await wait_pods(api, NS, 4, timeout=90)
    assert len({p["spec"]["nodeName"] for p in pods}) == 4, "one channel-0 per node: the pods spread"
    for pod in pods:
        nodes = edits(pod)["ctr"]["deviceNodes"]
        assert "/dev/nvidia-caps-imex-channels/channel0" in str(nodes), nodes

    domain = await wait_for_object(
        custom,
        GROUP,
        VERSION,
        NS,
        PLURAL,
        "train",
        lambda obj: ((obj or {}).get("status") or {}).get("status") == "Ready",
        timeout=60,
    )
    listed = domain["status"]["nodes"]
    assert sorted(n["name"] for n in listed) == sorted(cluster.node_names)
    by_clique: dict[str, list[int]] = {}
    for n in listed:
        assert n["status"] == "Ready" and n["ipAddress"].startswith("127.0.")
        by_clique.setdefault(n["cliqueID"], []).append(n["index"])
    assert len(by_clique) == 2, f"two NVLink cliques: {listed}"
    assert all(sorted(indices) == [0, 1] for indices in by_clique.values()), by_clique
    assert len(imex_daemons(cluster)) == 4
    uid = domain["metadata"]["uid"]
    ready = await _domain_events(api, uid, "ComputeDomainReady")
    assert ready and ready[0]["involvedObject"]["kind"] == "ComputeDomain" and "Ready" in ready[0]["message"]

    # Tear down: the workload, then the domain; nothing may stay behind or stuck Terminating.
    await apps.delete_namespaced_deployment("trainer", NS)
    await wait_pods(api, NS, 0, timeout=60)
    await custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "train")
    await wait_for_object(custom, GROUP, VERSION, NS, PLURAL, "train", lambda obj: obj is None, timeout=60)
    claims = await custom.list_namespaced_custom_object("resource.k8s.io", "v1", NS, "resourceclaims")
    templates = await custom.list_namespaced_custom_object("resource.k8s.io", "v1", NS, "resourceclaimtemplates")
    assert claims["items"] == [] and templates["items"] == []
    assert await pods_in(api, NS) == []
    assert cluster.bus is not None
    assert await Membership(cluster.bus).members(uid) == {}
    await no_daemons_left(cluster)


async def no_daemons_left(cluster: LocalCluster, timeout: float = 15.0) -> None:
    """A process's exit has no event a test can await: look at the process table until the IMEX
    daemons are gone, bounded, so that a daemon left running fails with its command line."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (left := imex_daemons(cluster)) and loop.time() < deadline:
        await asyncio.sleep(0.2)
    assert left == [], f"IMEX daemons still running {timeout:.0f}s after their domain was deleted: {left}"
