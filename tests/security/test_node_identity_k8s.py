"""A kubelet speaks only for its own node to the API server: attacks by node gpu-node-0's kubelet
credentials (user `system:node:gpu-node-0`, group `system:nodes`, a static token as `gpu-dra up` writes
it, with deploy/'s RBAC and policies and the embedded roles installed as `up` installs them) on node
gpu-node-1, over HTTP and kubectl against the embedded API server. The Node authorizer and
NodeRestriction refuse each with upstream's 403 and leave the object as it was; each probe is played
again where it is allowed (gpu-node-0 on its own objects, the admin across nodes), so it can fail.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from embedded.apiserver.testing import RunningApiServer, running_apiserver
from embedded.cluster import identities

NODE0, NODE1 = "gpu-node-0", "gpu-node-1"
DRIVER = "dra.example.com"  # not ours: deploy/'s policy (only the publisher writes gpu.nvidia.com slices) stays out
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
PODS = "/api/v1/namespaces/default/pods"
NO_RELATIONSHIP = "no relationship found between node 'gpu-node-0' and this object"


@dataclass
class Cluster:
    api: RunningApiServer
    tokens: dict[str, str]
    session: aiohttp.ClientSession

    async def call(
        self, method: str, path: str, who: str = "admin", body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        token = self.api.token if who == "admin" else self.tokens[who]
        data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        async with self.session.request(
            method,
            self.api.url + path,
            data=data,
            ssl=False,
            headers={"Authorization": f"Bearer {token}", "Content-Type": content_type},
        ) as resp:
            text = await resp.text()
            return resp.status, json.loads(text) if text else None

    async def ok(
        self, method: str, path: str, who: str = "admin", body: Any = None, content_type: str = "application/json"
    ) -> Any:
        status, out = await self.call(method, path, who, body, content_type)
        assert status in (200, 201), (method, path, who, status, out)
        return out

    async def refused(
        self, method: str, path: str, who: str, body: Any = None, content_type: str = "application/json"
    ) -> str:
        """The request is a 403 Forbidden Status; its message."""
        status, out = await self.call(method, path, who, body, content_type)
        assert status == 403 and out["reason"] == "Forbidden" and out["code"] == 403, (method, path, status, out)
        return str(out["message"])

    async def version(self, path: str) -> str:
        return str((await self.ok("GET", path))["metadata"]["resourceVersion"])


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    tokens = identities.kubelet_tokens([NODE0, NODE1])
    token_file = identities.write_secret(tmp_path / "tokens.csv", identities.token_file_text(tokens))
    async with running_apiserver(tmp_path, token_file=token_file) as api, aiohttp.ClientSession() as session:
        kube = Cluster(api, tokens, session)
        await kube.ok("POST", "/api/v1/namespaces", body={"metadata": {"name": "gpu-dra"}})
        async with api.client() as client:
            await identities.install(client)
        for node in (NODE0, NODE1):  # each kubelet registers its own Node, as the emulator does
            await kube.ok(
                "POST",
                "/api/v1/nodes",
                node,
                {"metadata": {"name": node, "labels": {"kubernetes.io/hostname": node, "kubernetes.io/os": "linux"}}},
            )
        await kube.ok("POST", "/api/v1/namespaces/default/serviceaccounts", body={"metadata": {"name": "runner"}})
        for node, secret in ((NODE0, "s0"), (NODE1, "s1")):
            await kube.ok("POST", "/api/v1/namespaces/default/secrets", body={"metadata": {"name": secret}})
            await kube.ok(
                "POST",
                "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims",
                body={
                    "metadata": {"name": f"claim-{node}"},
                    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
                },
            )
            await kube.ok("POST", PODS, body=pod(f"pod-{node}", node, secret=secret, claim=f"claim-{node}"))
            await kube.ok("POST", SLICES, body=resource_slice(f"slice-{node}", node))
        yield kube


def pod(name: str, node: str, secret: str = "", claim: str = "", **metadata: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": node, "containers": [{"name": "c", "image": "busybox:1"}]}
    if secret:
        spec["serviceAccountName"] = "runner"
        spec["volumes"] = [{"name": "s", "secret": {"secretName": secret}}]
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **metadata}, "spec": spec}


def resource_slice(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


def forbidden(user_verb: str, resource: str, group: str, where: str, reason: str, named: str) -> str:
    """upstream's authorization 403 message for node gpu-node-0."""
    return (
        f'{named} is forbidden: User "system:node:gpu-node-0" cannot {user_verb} resource "{resource}" in API '
        f'group "{group}" {where}: {reason}'
    )


async def _mirror_pod(kube: Cluster, name: str, node: str, **spec: Any) -> dict[str, Any]:
    owner = await kube.ok("GET", f"/api/v1/nodes/{node}")
    body = pod(
        name,
        node,
        annotations={"kubernetes.io/config.mirror": "hash"},
        ownerReferences=[
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": owner["metadata"]["uid"], "controller": True}
        ],
    )
    body["spec"].update(spec)
    return body


# ---- pods


async def test_a_kubelet_creates_no_pod_on_another_node(cluster: Cluster) -> None:
    kube = cluster
    message = await kube.refused("POST", PODS, NODE0, pod("evil", NODE1))
    assert message == (
        'pods "evil" is forbidden: pod does not have "kubernetes.io/config.mirror" annotation, '
        'node "gpu-node-0" can only create mirror pods'
    )
    message = await kube.refused("POST", PODS, NODE0, await _mirror_pod(kube, "evil", NODE1))
    assert (
        message == 'pods "evil" is forbidden: node "gpu-node-0" can only create pods with spec.nodeName set to itself'
    )
    assert (await kube.call("GET", f"{PODS}/evil"))[0] == 404  # nothing stored

    # its own mirror pods, if they name nothing of the API's (upstream's rules for static pods)
    for spec, why in (
        ({"serviceAccountName": "runner"}, "reference a service account"),
        ({"volumes": [{"name": "s", "secret": {"secretName": "s1"}}]}, "reference secrets"),
        ({"resourceClaims": [{"name": "gpu", "resourceClaimName": "claim-gpu-node-1"}]}, "reference resourceclaims"),
    ):
        message = await kube.refused("POST", PODS, NODE0, await _mirror_pod(kube, "static", NODE0, **spec))
        assert message == f'pods "static" is forbidden: node "gpu-node-0" can not create pods that {why}'
    created = await kube.ok("POST", PODS, NODE0, await _mirror_pod(kube, "static", NODE0))
    assert created["spec"]["nodeName"] == NODE0 and "serviceAccountName" not in created["spec"]
    await kube.ok("POST", PODS, body=pod("placed", NODE1))  # the admin (the scheduler's work) may


async def test_a_kubelet_writes_status_of_and_deletes_only_its_own_pods(cluster: Cluster) -> None:
    kube = cluster
    path1, path0 = f"{PODS}/pod-{NODE1}", f"{PODS}/pod-{NODE0}"
    before = await kube.version(path1)
    status = {"status": {"phase": "Failed", "message": "forged by gpu-node-0"}}
    message = await kube.refused("PATCH", f"{path1}/status", NODE0, status, "application/merge-patch+json")
    assert message == (
        f'pods "pod-{NODE1}" is forbidden: node "gpu-node-0" can only update pod status for pods '
        "with spec.nodeName set to itself"
    )
    message = await kube.refused("DELETE", path1, NODE0)
    assert (
        message
        == 'pods "Unknown" is forbidden: node "gpu-node-0" can only delete pods with spec.nodeName set to itself'
    )
    assert await kube.version(path1) == before
    message = await kube.refused(
        "PATCH", path1, NODE0, {"metadata": {"labels": {"x": "y"}}}, "application/merge-patch+json"
    )
    assert message == (
        f'pods "pod-{NODE1}" is forbidden: User "system:node:gpu-node-0" cannot patch resource "pods" '
        'in API group "" in the namespace "default"'
    )  # no node may, nor does RBAC grant it

    relabel = {"metadata": {"labels": {"stolen": "yes"}}, "status": {"phase": "Running"}}
    message = await kube.refused("PATCH", f"{path0}/status", NODE0, relabel, "application/merge-patch+json")
    assert message == f'pods "pod-{NODE0}" is forbidden: node "gpu-node-0" cannot update labels through pod status'
    patched = await kube.ok(
        "PATCH", f"{path0}/status", NODE0, {"status": {"phase": "Running"}}, "application/merge-patch+json"
    )
    assert patched["status"]["phase"] == "Running"
    await kube.ok("DELETE", path0, NODE0, {"gracePeriodSeconds": 0})
    await kube.ok("PATCH", f"{path1}/status", body=status, content_type="application/merge-patch+json")


async def test_a_kubelet_reads_only_what_its_own_pods_name(cluster: Cluster) -> None:
    kube = cluster
    claims = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
    message = await kube.refused("GET", f"{claims}/claim-{NODE1}", NODE0)
    assert message == forbidden(
        "get",
        "resourceclaims",
        "resource.k8s.io",
        'in the namespace "default"',
        NO_RELATIONSHIP,
        f'resourceclaims.resource.k8s.io "claim-{NODE1}"',
    )
    await kube.ok("GET", f"{claims}/claim-{NODE0}", NODE0)
    message = await kube.refused("GET", "/api/v1/namespaces/default/secrets/s1", NODE0)
    assert message.endswith(NO_RELATIONSHIP)
    await kube.ok("GET", "/api/v1/namespaces/default/secrets/s0", NODE0)
    assert (await kube.refused("GET", f"{PODS}/pod-{NODE1}", NODE0)).endswith(NO_RELATIONSHIP)
    await kube.ok("GET", f"{PODS}/pod-{NODE0}", NODE0)
    message = await kube.refused("GET", PODS, NODE0)
    assert message.endswith(": can only list/watch pods with spec.nodeName field selector")
    listed = await kube.ok("GET", f"{PODS}?fieldSelector=spec.nodeName%3D{NODE0}", NODE0)
    assert [p["metadata"]["name"] for p in listed["items"]] == [f"pod-{NODE0}"]
    message = await kube.refused("GET", f"/api/v1/nodes/{NODE1}", NODE0)
    assert message.endswith(": node 'gpu-node-0' cannot read 'gpu-node-1', only its own Node object")
    await kube.ok("GET", f"/api/v1/nodes/{NODE0}", NODE0)


# ---- ServiceAccount tokens


async def test_a_kubelet_gets_no_token_bound_to_a_pod_on_another_node(cluster: Cluster) -> None:
    kube = cluster
    pod1 = await kube.ok("GET", f"{PODS}/pod-{NODE1}")
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "audiences": ["nats"],
            "boundObjectRef": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": f"pod-{NODE1}",
                "uid": pod1["metadata"]["uid"],
            },
        },
    }
    token_path = "/api/v1/namespaces/default/serviceaccounts/runner/token"
    # While only gpu-node-1's pod runs as `runner`, gpu-node-0 may not ask for its tokens at all (Node authorizer).
    await kube.ok("DELETE", f"{PODS}/pod-{NODE0}", body={"gracePeriodSeconds": 0})
    status, out = await kube.call("POST", token_path, NODE0, request)
    assert status == 403 and "token" not in json.dumps(out.get("status") or {}), out
    assert out["message"] == forbidden(
        "create", "serviceaccounts/token", "", 'in the namespace "default"', NO_RELATIONSHIP, 'serviceaccounts "runner"'
    )
    # Once a pod of its own runs as `runner`, it may, but bound only to that pod (NodeRestriction).
    own = await kube.ok("POST", PODS, body=pod("mine", NODE0, secret="s0"))
    message = await kube.refused("POST", token_path, NODE0, request)
    assert (
        message
        == 'serviceaccounts "Unknown" is forbidden: node requested token bound to a pod scheduled on a different node'
    )
    for ref, why in (
        ({"apiVersion": "v1", "kind": "Pod", "name": "mine"}, "with a pod binding without a uid"),
        (None, "not bound to a pod"),
    ):
        unbound = {**request, "spec": {"audiences": ["nats"], "boundObjectRef": ref}}
        assert (
            await kube.refused("POST", token_path, NODE0, unbound)
            == f'serviceaccounts "Unknown" is forbidden: node requested token {why}'
        )
    mine = {
        **request,
        "spec": {
            "audiences": ["nats"],
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": "mine", "uid": own["metadata"]["uid"]},
        },
    }
    issued = await kube.ok("POST", token_path, NODE0, mine)
    review = await kube.ok(
        "POST",
        "/apis/authentication.k8s.io/v1/tokenreviews",
        body={"spec": {"token": issued["status"]["token"], "audiences": ["nats"]}},
    )
    assert review["status"]["user"]["extra"]["authentication.kubernetes.io/node-name"] == [NODE0]
    await kube.ok("POST", token_path, body=request)  # the admin may bind one to gpu-node-1's pod


# ---- ResourceSlices


async def test_a_kubelet_cannot_update_or_delete_another_nodes_slice(cluster: Cluster) -> None:
    kube = cluster
    path = f"{SLICES}/slice-{NODE1}"
    before = await kube.ok("GET", path)
    named = f'resourceslices.resource.k8s.io "slice-{NODE1}"'
    for verb, method, body, ctype in (
        ("delete", "DELETE", None, "application/json"),
        ("update", "PUT", {**before, "spec": {**before["spec"], "devices": []}}, "application/json"),
        ("patch", "PATCH", {"spec": {"devices": []}}, "application/merge-patch+json"),
    ):
        message = await kube.refused(method, path, NODE0, body, ctype)
        assert message == forbidden(
            verb, "resourceslices", "resource.k8s.io", "at the cluster scope", NO_RELATIONSHIP, named
        )
    for query in ("", f"?fieldSelector=spec.nodeName%3D{NODE1}"):
        message = await kube.refused("DELETE", SLICES + query, NODE0)
        assert message.endswith(": can only list/watch/deletecollection resourceslices with nodeName field selector")
    message = await kube.refused("POST", SLICES, NODE0, resource_slice("forged", NODE1))
    assert message == (
        'resourceslices.resource.k8s.io "forged" is forbidden: can only create ResourceSlice with '
        "the same NodeName as the requesting node"
    )
    after = await kube.ok("GET", path)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["spec"] == before["spec"]

    # its own: created, updated, deleted (also as a collection, which takes only its own)
    await kube.ok("POST", SLICES, NODE0, resource_slice("extra", NODE0))
    own = await kube.ok("GET", f"{SLICES}/slice-{NODE0}", NODE0)
    await kube.ok("PUT", f"{SLICES}/slice-{NODE0}", NODE0, {**own, "spec": {**own["spec"], "devices": []}})
    gone = await kube.ok("DELETE", f"{SLICES}?fieldSelector=spec.nodeName%3D{NODE0}", NODE0)
    assert sorted(s["metadata"]["name"] for s in gone["items"]) == ["extra", f"slice-{NODE0}"]
    assert (await kube.call("GET", path))[0] == 200
    await kube.ok("DELETE", path)  # the admin may


async def test_kubectl_shows_the_upstream_forbidden(cluster: Cluster, tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed on this machine")
    config = await identities.write_kubeconfig(
        cluster.api.kubeconfig_path, cluster.tokens[NODE0], tmp_path / "node0.kubeconfig"
    )
    proc = await asyncio.create_subprocess_exec(
        kubectl,
        "--kubeconfig",
        str(config),
        "--cache-dir",
        str(tmp_path / "cache"),
        "delete",
        "resourceslice",
        f"slice-{NODE1}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode != 0, out
    assert err.decode().strip() == "Error from server (Forbidden): " + forbidden(
        "delete",
        "resourceslices",
        "resource.k8s.io",
        "at the cluster scope",
        NO_RELATIONSHIP,
        f'resourceslices.resource.k8s.io "slice-{NODE1}"',
    )
    assert (await cluster.call("GET", f"{SLICES}/slice-{NODE1}"))[0] == 200


# ---- Nodes and Leases


async def test_a_kubelet_modifies_only_its_own_node_and_not_its_taints_or_role(cluster: Cluster) -> None:
    kube = cluster
    path1, path0 = f"/api/v1/nodes/{NODE1}", f"/api/v1/nodes/{NODE0}"
    before = await kube.version(path1)
    merge = "application/merge-patch+json"
    unschedulable = {"spec": {"unschedulable": True}}
    for sub in ("", "/status"):
        message = await kube.refused(
            "PATCH", path1 + sub, NODE0, unschedulable if not sub else {"status": {"conditions": []}}, merge
        )
        assert message == f'nodes "{NODE1}" is forbidden: node "gpu-node-0" is not allowed to modify node "{NODE1}"'
    assert await kube.version(path1) == before

    taint = {"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}}
    assert (
        await kube.refused("PATCH", path0, NODE0, taint, merge)
        == f'nodes "{NODE0}" is forbidden: node "gpu-node-0" is not allowed to modify taints'
    )
    role = {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}}
    assert (
        await kube.refused("PATCH", path0, NODE0, role, merge)
        == f'nodes "{NODE0}" is forbidden: is not allowed to modify labels: node-role.kubernetes.io/control-plane'
    )
    await kube.ok("PATCH", path0, NODE0, {"metadata": {"labels": {"example.com/rack": "a"}}}, merge)
    await kube.ok("PATCH", path0 + "/status", NODE0, {"status": {"conditions": []}}, merge)
    await kube.ok("PATCH", path1, body=taint, content_type=merge)  # the admin may


async def test_a_kubelet_holds_only_its_own_lease(cluster: Cluster) -> None:
    kube = cluster
    leases = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": NODE1},
        "spec": {"holderIdentity": NODE1},
    }
    assert (
        await kube.refused("POST", leases, NODE0, lease)
        == f'leases.coordination.k8s.io "{NODE1}" is forbidden: can only access node lease with the same name as the '
        "requesting node"
    )
    await kube.ok("POST", leases, NODE1, lease)
    message = await kube.refused(
        "PATCH", f"{leases}/{NODE1}", NODE0, {"spec": {"holderIdentity": NODE0}}, "application/merge-patch+json"
    )
    assert message.endswith(": can only access node lease with the same name as the requesting node")
    await kube.ok("POST", leases, NODE0, {**lease, "metadata": {"name": NODE0}})


async def test_can_i_answers_for_a_node_as_its_requests_are_answered(cluster: Cluster) -> None:
    kube = cluster

    async def can(name: str) -> dict[str, Any]:
        review = await kube.ok(
            "POST",
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            NODE0,
            {"spec": {"resourceAttributes": {"verb": "get", "resource": "pods", "namespace": "default", "name": name}}},
        )
        return dict(review["status"])

    assert await can(f"pod-{NODE0}") == {"allowed": True}
    assert await can(f"pod-{NODE1}") == {"allowed": False, "reason": NO_RELATIONSHIP}
    rules = await kube.ok(
        "POST", "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews", NODE0, {"spec": {"namespace": "default"}}
    )
    assert rules["status"]["incomplete"] is True
    assert rules["status"]["evaluationError"] == "node authorizer does not support user rule resolution"


async def test_up_replaces_a_kubelet_role_broader_than_todays(cluster: Cluster) -> None:
    """A data dir from before keeps no kubelet rule that would grant again what the Node authorizer refuses."""
    kube = cluster
    path = "/apis/rbac.authorization.k8s.io/v1/clusterroles/gpu-dra:embedded-kubelet"
    role = await kube.ok("GET", path)
    wide = {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["patch"]}
    await kube.ok("PUT", path, body={**role, "rules": [*role["rules"], wide]})
    relabel = {"metadata": {"labels": {"owner": NODE0}}}
    merge = "application/merge-patch+json"
    await kube.ok("PATCH", f"{SLICES}/slice-{NODE1}", NODE0, relabel, merge)  # RBAC granted it again
    async with kube.api.client() as client:
        await identities.install(client)  # as every `gpu-dra up` does
    assert (await kube.ok("GET", path))["rules"] == identities.EMBEDDED_ROLES["gpu-dra:embedded-kubelet"][0]
    assert (await kube.refused("PATCH", f"{SLICES}/slice-{NODE1}", NODE0, relabel, merge)).endswith(NO_RELATIONSHIP)
