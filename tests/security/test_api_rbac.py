"""On `gpu-dra up`'s cluster (real processes): every service runs under its own identity with
deploy/'s RBAC, a call outside its rules is denied with the upstream 403, removing a rule takes
the right away at once, deploy/'s admission policy refuses a forged slice of our driver even to
the admin, and no credential is on any process's argv or environment."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.cluster.local import ClusterConfig, LocalCluster
from shared.kube.client import kube_api_client

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]
GROUP, VERSION = "resource.k8s.io", "v1"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    root = tmp_path_factory.mktemp("rbaccluster")
    cfg = ClusterConfig(nodes=1, gpus="h100x2", data_dir=str(root / "data"), start_timeout=120)
    async with LocalCluster(cfg) as c:
        yield c


def _token(kubeconfig: Path) -> str:
    return str(yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"])


def _descendants(pids: set[int]) -> set[int]:
    """`pids` and every process below them (from /proc/<pid>/stat's parent pid)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found = set(pids)
    grew = True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in found} - found
        found |= below
        grew = bool(below)
    return found


def _slice(name: str, node: str) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 99, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


async def test_no_credential_on_any_argv_or_environment(cluster: LocalCluster) -> None:
    assert cluster.supervisor is not None
    secrets = {_token(cluster.kubeconfig_path)} | {_token(p) for p in cluster.kubeconfigs.values()}
    assert len(secrets) == len(cluster.kubeconfigs) + 1  # every identity its own token
    children = [c for c in cluster.supervisor.children if c.process and c.process.returncode is None]
    assert {c.name for c in children} >= {"apiserver", "publisher", "scheduler", "controllers"}
    assert {c.name for c in children} >= {f"{cluster.node_names[0]}-{s}" for s in ("preparer", "kubelet", "cd-agent")}
    processes = _descendants({c.pid for c in children})
    for pid in processes:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        assert "--token\x00" not in cmdline, cmdline
        for secret in secrets:
            assert secret not in cmdline, f"a token is on the argv of {cmdline!r}"
            assert secret not in environ, f"a token is in the environment of {cmdline!r}"
    for path in [cluster.kubeconfig_path, *cluster.kubeconfigs.values()]:
        assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"


async def test_node_identity_is_denied_what_deploy_does_not_grant(cluster: LocalCluster) -> None:
    node = cluster.node_names[0]
    async with await kube_api_client(str(cluster.kubeconfigs["node"])) as api:
        claims = await client.CustomObjectsApi(api).list_namespaced_custom_object(
            GROUP, VERSION, "default", "resourceclaims"
        )
        assert claims["items"] == []  # granted: the preparer reads claims
        with pytest.raises(ApiException) as denied:
            await client.CustomObjectsApi(api).create_cluster_custom_object(
                GROUP, VERSION, "resourceslices", _slice("forged", node)
            )
        assert denied.value.status == 403 and denied.value.body is not None
        assert json.loads(denied.value.body)["message"] == (
            'resourceslices.resource.k8s.io is forbidden: User "system:serviceaccount:gpu-dra:gpu-dra-node" '
            'cannot create resource "resourceslices" in API group "resource.k8s.io" at the cluster scope'
        )
        with pytest.raises(ApiException) as secrets:
            await client.CoreV1Api(api).list_namespaced_secret("gpu-dra")
        assert secrets.value.status == 403


async def test_admission_policy_refuses_a_forged_slice_even_to_the_admin(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    with pytest.raises(ApiException) as denied:
        await client.CustomObjectsApi(api).create_cluster_custom_object(
            GROUP, VERSION, "resourceslices", _slice("forged-by-admin", cluster.node_names[0])
        )
    assert denied.value.status == 403 and denied.value.body is not None
    assert (
        "ValidatingAdmissionPolicy 'gpu-dra-resourceslices' with binding 'gpu-dra-resourceslices' denied "
        "request: ResourceSlices of driver gpu.nvidia.com are written only by gpu-dra-publisher, not by "
        "kubernetes-admin"
    ) in json.loads(denied.value.body)["message"]


async def _can_i(kubeconfig: Path, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        "kubectl",
        "--kubeconfig",
        str(kubeconfig),
        "auth",
        "can-i",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode().strip()


async def test_a_removed_rule_takes_the_right_away_at_once(cluster: LocalCluster) -> None:
    """Last in the module: it removes the publisher's binding."""
    import shutil

    if shutil.which("kubectl") is None:
        pytest.skip("needs kubectl")
    publisher = cluster.kubeconfigs["publisher"]
    assert await _can_i(publisher, "create", "resourceslices.resource.k8s.io") == (0, "yes")
    assert await _can_i(cluster.kubeconfigs["node"], "create", "resourceslices.resource.k8s.io") == (1, "no")
    assert await _can_i(cluster.kubeconfigs["node"], "list", "resourceclaims.resource.k8s.io") == (0, "yes")
    api = await cluster.api_client()
    await client.RbacAuthorizationV1Api(api).delete_cluster_role_binding("gpu-dra-publisher")
    assert await _can_i(publisher, "create", "resourceslices.resource.k8s.io") == (1, "no")
    async with await kube_api_client(str(publisher)) as as_publisher:
        with pytest.raises(ApiException) as denied:
            await client.CustomObjectsApi(as_publisher).list_cluster_custom_object(GROUP, VERSION, "resourceslices")
        assert denied.value.status == 403
