"""`gpu-dra explain` as a subprocess against a cluster the scheduler loop is working on."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

from embedded.cluster.explain import explain_pod
from embedded.scheduler.state import ClusterState
from shared.kube.resources import NODES, PODS, RESOURCECLAIMS, RESOURCECLAIMTEMPLATES, RESOURCESLICES
from tests.polling import eventually
from tests.scheduler.loophelpers import cluster, condition
from tests.scheduler.test_loop import template

ROOT = Path(__file__).resolve().parents[2]


async def explain(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "shared.cli", "explain", *args, "--kubeconfig", str(kubeconfig)]
    return await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


async def test_explain_pending_and_bound_pods_and_claims(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=2) as c:
        sel = "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA B200'"
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("b200", selector=sel))
        await c.kube.create(RESOURCECLAIMTEMPLATES, "default", template("one-gpu"))
        await c.pod("x", [{"name": "gpu", "resourceClaimTemplateName": "b200"}])
        await c.pod("ok", [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])

        async def settled() -> Any:
            x, ok = await c.get_pod("x"), await c.get_pod("ok")
            cond = condition(x)
            return cond and cond["status"] == "False" and ok["spec"].get("nodeName")

        await eventually(settled, what="x unschedulable and ok bound")
        kubeconfig = c.api.kubeconfig_path
        pending, bound, missing, bad = await asyncio.gather(
            explain(kubeconfig, "pod", "default/x"),
            explain(kubeconfig, "pod", "default/ok"),
            explain(kubeconfig, "pod", "default/nope"),
            explain(kubeconfig, "node", "default/x"),
        )
        assert pending.returncode == 0, pending.stderr
        out = pending.stdout
        assert "pod default/x: not scheduled" in out
        assert "PodScheduled=False (Unschedulable)" in out
        assert "claim default/x-gpu-" in out and "not allocated" in out
        for node in ("node-0", "node-1"):  # every node is reported, not just the first that failed
            assert f"node {node}: does not fit" in out
        assert "request gpu (class gpu.nvidia.com, wants 1)" in out
        assert "rejected: selector" in out

        assert bound.returncode == 0, bound.stderr
        assert "bound to node node-0" in bound.stdout
        assert "allocated" in bound.stdout and "device gpu-" in bound.stdout and "reserved for: pods/ok" in bound.stdout

        assert missing.returncode == 1 and "pod default/nope not found" in missing.stderr
        assert bad.returncode == 2 and "invalid choice" in bad.stderr

        claims, _ = await c.kube.list(RESOURCECLAIMS, "default")
        x_claim = next(cl["metadata"]["name"] for cl in claims if cl["metadata"]["name"].startswith("x-gpu-"))
        claim_out = await explain(kubeconfig, "claim", f"default/{x_claim}")
        assert claim_out.returncode == 0, claim_out.stderr
        assert "node node-1: does not fit" in claim_out.stdout
        no_ns = await explain(kubeconfig, "claim", "a/b/c")
        assert no_ns.returncode == 2 and "NS/NAME" in no_ns.stderr


def test_explain_a_bound_pod_stuck_in_prepare_names_the_failure_the_device_and_the_node() -> None:
    state = ClusterState()
    result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"}
    state.replace_all(
        RESOURCECLAIMS,
        [
            {
                "metadata": {"name": "c", "namespace": "default", "uid": "cu"},
                "status": {
                    "allocation": {"devices": {"results": [result]}},
                    "reservedFor": [{"resource": "pods", "name": "p", "uid": "pu"}],
                },
            }
        ],
    )
    state.replace_all(
        PODS,
        [
            {
                "metadata": {"name": "p", "namespace": "default", "uid": "pu"},
                "spec": {"nodeName": "n1", "resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}]},
                "status": {"phase": "Pending"},
            }
        ],
    )
    state.replace_all(
        RESOURCESLICES,
        [
            {
                "metadata": {"name": "s"},
                "spec": {
                    "driver": "gpu.nvidia.com",
                    "pool": {"name": "n1"},
                    "devices": [
                        {
                            "name": "gpu-0",
                            "taints": [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}],
                        },
                        {
                            "name": "gpu-1",
                            "taints": [{"key": "gpu.nvidia.com/xid", "value": "48", "effect": "NoSchedule"}],
                        },
                    ],
                },
            }
        ],
    )
    state.replace_all(
        NODES,
        [
            {
                "metadata": {"name": "n1"},
                "spec": {"taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]},
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "Unknown",
                            "reason": "NodeStatusUnknown",
                            "message": "kubelet stopped posting",
                        }
                    ]
                },
            }
        ],
    )
    events = [
        {
            "reason": "FailedPrepareDynamicResources",
            "involvedObject": {"uid": "pu"},
            "count": 2,
            "lastTimestamp": "2026-01-01T00:00:02Z",
            "message": "gpu.nvidia.com could not prepare default/c: boom",
        },
        {
            "reason": "FailedPrepareDynamicResources",
            "involvedObject": {"uid": "other"},
            "count": 1,
            "lastTimestamp": "2026-01-01T00:00:03Z",
            "message": "not this pod",
        },
    ]
    out = explain_pod(state, "default", "p", events)
    assert "prepare on node n1 failed (2x, last at 2026-01-01T00:00:02Z): gpu.nvidia.com could not prepare" in out
    assert "not this pod" not in out
    assert "device gpu.nvidia.com/n1/gpu-0 is tainted: gpu.nvidia.com/xid=79:NoSchedule" in out
    assert "gpu-1" not in out  # not the pod's device
    assert (
        "node n1: Ready=Unknown (NodeStatusUnknown: kubelet stopped posting); taints: "
        "node.kubernetes.io/unreachable:NoExecute" in out
    )
    waiting = explain_pod(state, "default", "p", [])
    assert "waiting for the kubelet on node n1 to prepare the claims (no failure reported)" in waiting
