"""The embedded server's request chain as a real one runs it: static tokens from a token file and
ServiceAccount tokens from the TokenRequest API (401 for anything else), RBAC from stored Roles
and bindings (403 with the upstream message, over raw HTTP, kubernetes-asyncio and kubectl),
SelfSubjectAccessReview for `kubectl auth can-i`, impersonation (`kubectl --as`), deploy/'s
ValidatingAdmissionPolicy, and the size limits (413 over 3 MiB of body, 422 over 1 MiB of ConfigMap data)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.apiserver.testing import RunningApiServer, running_apiserver
from embedded.cluster.apply import Applier
from tests.apiserver.conftest import KUBECTL
from tests.apiserver.test_crud import slice_body

REPO = Path(__file__).resolve().parents[2]
ADMISSION = REPO / "deploy/kubernetes/base/admission.yaml"
ALICE = "alice-token-0123456789"


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[RunningApiServer]:
    tokens = tmp_path / "tokens.csv"
    tokens.write_text(f'{ALICE},alice,1001,"dev,qa"\n')
    async with running_apiserver(tmp_path, token_file=tokens) as server:
        yield server


async def _http(
    api: RunningApiServer,
    method: str,
    path: str,
    token: str,
    body: Any = None,
    raw: bytes | None = None,
    headers: list[tuple[str, str]] | None = None,
) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = [("Authorization", f"Bearer {token}"), ("Content-Type", "application/json"), *(headers or [])]
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, api.url + path, data=data, headers=headers, ssl=False) as resp,
    ):
        text = await resp.text()
        return resp.status, json.loads(text) if text else None


async def _admin(api: RunningApiServer, method: str, path: str, body: Any = None) -> Any:
    status, out = await _http(api, method, path, api.token, body)
    assert status in (200, 201), (status, out)
    return out


async def _grant_alice_pod_reading(api: RunningApiServer) -> None:
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles",
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
    )
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings",
        {
            "metadata": {"name": "qa-reads-pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "qa"}],
        },
    )


async def test_unknown_token_is_401_and_known_one_is_its_own_identity(api: RunningApiServer) -> None:
    status, body = await _http(api, "GET", "/api/v1/namespaces", "not-a-token")
    assert status == 401
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Unauthorized",
        "reason": "Unauthorized",
        "code": 401,
    }
    forged = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.AAAA"  # JWT-shaped, wrong signature
    assert (await _http(api, "GET", "/api/v1/namespaces", forged))[0] == 401
    # alice is authenticated (discovery is open to everyone authenticated) but holds no grant yet.
    assert (await _http(api, "GET", "/api", ALICE))[0] == 200
    status, body = await _http(api, "GET", "/api/v1/namespaces/default/pods", ALICE)
    assert status == 403 and body["reason"] == "Forbidden"
    assert body["message"] == (
        'pods is forbidden: User "alice" cannot list resource "pods" in API group "" in the namespace "default"'
    )
    assert body["details"] == {"kind": "pods"}


async def test_rbac_denies_then_role_binding_grants_exactly_what_it_says(api: RunningApiServer) -> None:
    await _grant_alice_pod_reading(api)
    assert (await _http(api, "GET", "/api/v1/namespaces/default/pods", ALICE))[0] == 200
    async with (
        aiohttp.ClientSession() as session,
        session.get(  # a watch: the status line, then close
            api.url + "/api/v1/namespaces/default/pods?watch=true",
            ssl=False,
            headers={"Authorization": f"Bearer {ALICE}"},
        ) as watch,
    ):
        assert watch.status == 200
    # Not in another namespace, not another verb, not cluster-wide.
    status, body = await _http(api, "GET", "/api/v1/namespaces/kube-system/pods", ALICE)
    assert status == 403 and 'in the namespace "kube-system"' in body["message"]
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    status, body = await _http(api, "POST", "/api/v1/namespaces/default/pods", ALICE, pod)
    assert status == 403 and 'cannot create resource "pods"' in body["message"]
    status, body = await _http(api, "GET", "/apis/resource.k8s.io/v1/resourceslices/s1", ALICE)
    assert status == 403
    assert body["message"] == (
        'resourceslices.resource.k8s.io "s1" is forbidden: User "alice" cannot get resource '
        '"resourceslices" in API group "resource.k8s.io" at the cluster scope'
    )
    assert body["details"] == {"name": "s1", "group": "resource.k8s.io", "kind": "resourceslices"}
    # A binding to a role that does not exist says so, as upstream's RBAC reason does.
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        {
            "metadata": {"name": "dangling"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "nope"},
            "subjects": [{"kind": "User", "name": "alice"}],
        },
    )
    status, body = await _http(api, "GET", "/api/v1/nodes", ALICE)
    assert status == 403 and body["message"].endswith(
        'at the cluster scope: RBAC: clusterrole.rbac.authorization.k8s.io "nope" not found'
    )
    # resourceNames: one ConfigMap by name, also as a list/watch of that name (as upstream reads fieldSelector).
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles",
        {
            "metadata": {"name": "one-cm"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": ["settings"],
                    "verbs": ["get", "list"],
                }
            ],
        },
    )
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings",
        {
            "metadata": {"name": "alice-one-cm"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "one-cm"},
            "subjects": [{"kind": "User", "name": "alice"}],
        },
    )
    await _admin(api, "POST", "/api/v1/namespaces/default/configmaps", {"metadata": {"name": "settings"}})
    assert (await _http(api, "GET", "/api/v1/namespaces/default/configmaps/settings", ALICE))[0] == 200
    assert (await _http(api, "GET", "/api/v1/namespaces/default/configmaps/other", ALICE))[0] == 403
    base = "/api/v1/namespaces/default/configmaps"
    assert (await _http(api, "GET", f"{base}?fieldSelector=metadata.name%3Dsettings", ALICE))[0] == 200
    assert (await _http(api, "GET", base, ALICE))[0] == 403


async def test_an_rbac_change_takes_effect_on_the_very_next_request(api: RunningApiServer) -> None:
    """Decisions are cached between RBAC changes: a role removed, a rule narrowed or widened, a binding
    removed each decide the next request (no stale allow or deny)."""
    pods = "/api/v1/namespaces/default/pods"
    roles = "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles"
    await _grant_alice_pod_reading(api)
    for _ in range(2):  # the second is answered from the cache
        assert (await _http(api, "GET", pods, ALICE))[0] == 200
    await _admin(api, "DELETE", f"{roles}/pod-reader")
    status, body = await _http(api, "GET", pods, ALICE)
    assert status == 403
    assert body["message"].endswith('RBAC: role.rbac.authorization.k8s.io "pod-reader" not found')
    role = await _admin(
        api,
        "POST",
        roles,
        {"metadata": {"name": "pod-reader"}, "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]},
    )
    status, body = await _http(api, "GET", pods, ALICE)  # the role is back, without `list`
    assert status == 403 and "RBAC:" not in body["message"]
    role["rules"][0]["verbs"] = ["get", "list"]
    await _admin(api, "PUT", f"{roles}/pod-reader", role)
    assert (await _http(api, "GET", pods, ALICE))[0] == 200
    await _admin(api, "DELETE", "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings/qa-reads-pods")
    assert (await _http(api, "GET", pods, ALICE))[0] == 403


async def test_service_account_token_through_kubernetes_asyncio(api: RunningApiServer, tmp_path: Path) -> None:
    await _admin(api, "POST", "/api/v1/namespaces/default/serviceaccounts", {"metadata": {"name": "robot"}})
    issued = await _admin(
        api,
        "POST",
        "/api/v1/namespaces/default/serviceaccounts/robot/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
    )
    assert issued["kind"] == "TokenRequest" and issued["status"]["expirationTimestamp"]
    token = issued["status"]["token"]
    kubeconfig = api.server.write_kubeconfig(tmp_path / "robot.kubeconfig", token=token)
    configuration = client.Configuration()
    from kubernetes_asyncio import config

    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    async with client.ApiClient(configuration) as robot:
        with pytest.raises(ApiException) as denied:
            await client.CoreV1Api(robot).list_namespaced_config_map("default")
        assert denied.value.status == 403
        assert json.loads(denied.value.body)["message"] == (
            'configmaps is forbidden: User "system:serviceaccount:default:robot" cannot list resource "configmaps" '
            'in API group "" in the namespace "default"'
        )
        # Bound through the ServiceAccount subject and through its groups.
        await _admin(
            api,
            "POST",
            "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            {
                "metadata": {"name": "cm-reader"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
            },
        )
        await _admin(
            api,
            "POST",
            "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings",
            {
                "metadata": {"name": "robot-cm"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cm-reader"},
                "subjects": [{"kind": "ServiceAccount", "name": "robot", "namespace": "default"}],
            },
        )
        listed = await client.CoreV1Api(robot).list_namespaced_config_map("default")
        assert listed.items == []
        with pytest.raises(ApiException) as elsewhere:
            await client.CoreV1Api(robot).list_namespaced_config_map("kube-system")
        assert elsewhere.value.status == 403
        # Deleting the ServiceAccount kills its tokens.
        await _admin(api, "DELETE", "/api/v1/namespaces/default/serviceaccounts/robot")
        with pytest.raises(ApiException) as gone:
            await client.CoreV1Api(robot).list_namespaced_config_map("default")
        assert gone.value.status == 401


async def _kubectl(kubeconfig: Path, cache: Path, *args: str) -> tuple[int, str, str]:
    import asyncio
    import os

    assert KUBECTL is not None
    proc = await asyncio.create_subprocess_exec(
        KUBECTL,
        "--cache-dir",
        str(cache),
        *args,
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
async def test_kubectl_auth_can_i_and_forbidden_error(api: RunningApiServer, tmp_path: Path) -> None:
    await _grant_alice_pod_reading(api)
    alice = api.server.write_kubeconfig(tmp_path / "alice.kubeconfig", token=ALICE)
    cache = tmp_path / "kubectl-cache"
    rc, out, _ = await _kubectl(alice, cache, "auth", "can-i", "list", "pods")
    assert (rc, out.strip()) == (0, "yes")
    rc, out, _ = await _kubectl(alice, cache, "auth", "can-i", "create", "pods")
    assert (rc, out.strip()) == (1, "no")
    rc, out, _ = await _kubectl(alice, cache, "auth", "can-i", "list", "pods", "-n", "kube-system")
    assert (rc, out.strip()) == (1, "no")
    rc, out, _ = await _kubectl(alice, cache, "auth", "can-i", "delete", "resourceslices.resource.k8s.io")
    assert (rc, out.strip()) == (1, "no")
    rc, out, _ = await _kubectl(api.kubeconfig_path, cache, "auth", "can-i", "delete", "resourceslices")
    assert (rc, out.strip()) == (0, "yes")  # the admin is in system:masters
    rc, out, err = await _kubectl(alice, cache, "auth", "can-i", "--list")
    assert rc == 0, err
    pods_row = next(line for line in out.splitlines() if line.startswith("pods "))
    assert "[get list watch]" in pods_row
    assert "selfsubjectaccessreviews.authorization.k8s.io" in out and "configmaps" not in out
    rc, _, err = await _kubectl(alice, cache, "get", "configmaps")
    assert rc == 1
    assert (
        'Error from server (Forbidden): configmaps is forbidden: User "alice" cannot list resource "configmaps" '
        'in API group "" in the namespace "default"'
    ) in err


def _as(user: str, *groups: str, uid: str = "", **extra: str) -> list[tuple[str, str]]:
    """The headers of `kubectl --as=<user> --as-group=<group>... --as-uid=<uid>` (and client-go's extras)."""
    out = [("Impersonate-User", user)] if user else []
    out += [("Impersonate-Group", g) for g in groups]
    out += [("Impersonate-Uid", uid)] if uid else []
    return out + [(f"Impersonate-Extra-{k}", v) for k, v in extra.items()]


async def _review(
    api: RunningApiServer,
    token: str,
    impersonate: list[tuple[str, str]],
    verb: str,
    resource: str,
    namespace: str = "default",
) -> bool:
    """SelfSubjectAccessReview (what `kubectl auth can-i` asks) under impersonation headers: allowed?"""
    status, body = await _http(
        api,
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        token,
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"verb": verb, "resource": resource, "namespace": namespace}},
        },
        headers=impersonate,
    )
    assert status == 201, (status, body)
    return bool(body["status"]["allowed"])


async def test_impersonation_acts_as_the_named_user_once_the_caller_may(api: RunningApiServer) -> None:
    await _grant_alice_pod_reading(api)  # to group qa
    pods = "/api/v1/namespaces/default/pods"
    # the admin (system:masters) may impersonate anyone; the user acting has only the groups named
    status, body = await _http(api, "GET", pods, api.token, headers=_as("alice"))
    assert status == 403 and body["message"] == (
        'pods is forbidden: User "alice" cannot list resource "pods" in API group "" in the namespace "default"'
    )
    assert (await _http(api, "GET", pods, api.token, headers=_as("alice", "qa")))[0] == 200
    assert await _review(api, api.token, _as("alice", "qa"), "list", "pods")
    assert not await _review(api, api.token, _as("alice"), "list", "pods")
    assert await _review(api, api.token, [], "list", "pods")  # no headers: the admin itself
    # a ServiceAccount's name: its groups, unless groups are named
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings",
        {
            "metadata": {"name": "default-sas-read-pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "Group", "name": "system:serviceaccounts:default"}],
        },
    )
    bot = "system:serviceaccount:default:bot"
    assert await _review(api, api.token, _as(bot), "list", "pods")
    assert not await _review(api, api.token, _as(bot, "dev"), "list", "pods")
    assert not await _review(api, api.token, _as("system:serviceaccount:other:bot"), "list", "pods")
    # alice may impersonate no one yet: the first thing named is refused with upstream's message
    status, body = await _http(api, "GET", pods, ALICE, headers=_as("bob"))
    assert status == 403 and body["message"] == (
        'users "bob" is forbidden: User "alice" cannot impersonate resource '
        '"users" in API group "" at the cluster scope'
    )
    assert body["details"] == {"name": "bob", "kind": "users"}
    status, body = await _http(api, "GET", pods, ALICE, headers=_as(bot))
    assert status == 403 and body["message"] == (
        'serviceaccounts "bot" is forbidden: User "alice" cannot impersonate resource "serviceaccounts" in API group '
        '"" in the namespace "default"'
    )
    # granted: bob only (resourceNames), and group qa; an extra or a uid needs its own grant
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        {
            "metadata": {"name": "impersonate-bob"},
            "rules": [
                {"apiGroups": [""], "resources": ["users"], "resourceNames": ["bob"], "verbs": ["impersonate"]},
                {"apiGroups": [""], "resources": ["groups"], "resourceNames": ["qa"], "verbs": ["impersonate"]},
            ],
        },
    )
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        {
            "metadata": {"name": "alice-impersonates-bob"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "impersonate-bob"},
            "subjects": [{"kind": "User", "name": "alice"}],
        },
    )
    assert (await _http(api, "GET", pods, ALICE, headers=_as("bob", "qa")))[0] == 200
    assert (await _http(api, "GET", pods, ALICE, headers=_as("bob")))[0] == 403  # bob himself cannot list pods
    status, body = await _http(api, "GET", pods, ALICE, headers=_as("carol", "qa"))
    assert status == 403 and body["message"].startswith('users "carol" is forbidden')
    status, body = await _http(api, "GET", pods, ALICE, headers=_as("bob", "qa", uid="42"))
    assert status == 403 and body["message"] == (
        'uids.authentication.k8s.io "42" is forbidden: User "alice" cannot impersonate resource "uids" in API group '
        '"authentication.k8s.io" at the cluster scope'
    )
    status, body = await _http(api, "GET", pods, ALICE, headers=_as("bob", "qa", **{"Scopes%2FA": "x"}))
    assert status == 403 and body["message"].startswith(
        'userextras.authentication.k8s.io "x" is forbidden: User "alice" cannot impersonate resource '
        '"userextras/scopes/a" in API group "authentication.k8s.io"'
    )
    # groups, a uid or extras without a user: refused as upstream refuses them
    for headers in (_as("", "qa"), _as("", uid="42"), _as("", Scope="x")):
        status, body = await _http(api, "GET", pods, api.token, headers=headers)
        assert status == 500 and body["message"].endswith("without impersonating a user"), (headers, body)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
async def test_kubectl_as_and_auth_can_i_as_impersonate(api: RunningApiServer, tmp_path: Path) -> None:
    await _grant_alice_pod_reading(api)
    alice = api.server.write_kubeconfig(tmp_path / "alice.kubeconfig", token=ALICE)
    cache = tmp_path / "kubectl-cache"
    admin = api.kubeconfig_path
    rc, out, _ = await _kubectl(admin, cache, "auth", "can-i", "list", "pods", "--as=alice", "--as-group=qa")
    assert (rc, out.strip()) == (0, "yes")
    rc, out, _ = await _kubectl(admin, cache, "auth", "can-i", "list", "pods", "--as=alice")
    assert (rc, out.strip()) == (1, "no")
    rc, out, _ = await _kubectl(
        admin, cache, "auth", "can-i", "delete", "resourceslices", "--as=alice", "--as-group=qa"
    )
    assert (rc, out.strip()) == (1, "no")
    rc, _, err = await _kubectl(alice, cache, "get", "pods", "--as=bob")
    assert rc == 1
    assert (
        'Error from server (Forbidden): users "bob" is forbidden: User "alice" cannot impersonate resource '
        '"users" in API group "" at the cluster scope'
    ) in err


async def test_deploy_admission_policy_lets_only_the_publisher_write_our_slices(api: RunningApiServer) -> None:
    async with api.client() as admin:
        applier = Applier(admin)
        await applier.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpu-dra"}})
        for doc in yaml.safe_load_all(ADMISSION.read_text()):
            await applier.create(doc)
    for name in ("gpu-dra-publisher", "gpu-dra-node"):
        await _admin(api, "POST", "/api/v1/namespaces/gpu-dra/serviceaccounts", {"metadata": {"name": name}})
    # Both may write slices as far as RBAC goes: the policy is what holds.
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        {
            "metadata": {"name": "slice-writer"},
            "rules": [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["*"]}],
        },
    )
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        {
            "metadata": {"name": "slice-writers"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "slice-writer"},
            "subjects": [{"kind": "Group", "name": "system:serviceaccounts:gpu-dra"}],
        },
    )
    tokens = {}
    for name in ("gpu-dra-publisher", "gpu-dra-node"):
        issued = await _admin(api, "POST", f"/api/v1/namespaces/gpu-dra/serviceaccounts/{name}/token", {"spec": {}})
        tokens[name] = issued["status"]["token"]
    path = "/apis/resource.k8s.io/v1/resourceslices"
    status, body = await _http(api, "POST", path, tokens["gpu-dra-node"], slice_body("forged"))
    assert status == 403 and body["reason"] == "Forbidden"
    assert body["message"] == (
        "resourceslices.resource.k8s.io \"forged\" is forbidden: ValidatingAdmissionPolicy 'gpu-dra-resourceslices' "
        "with binding 'gpu-dra-resourceslices' denied request: ResourceSlices of driver gpu.nvidia.com are written "
        "only by gpu-dra-publisher, not by system:serviceaccount:gpu-dra:gpu-dra-node"
    )
    assert (await _http(api, "GET", f"{path}/forged", api.token))[0] == 404  # nothing stored
    # Another driver's slices are not guarded; the publisher writes ours.
    status, _ = await _http(api, "POST", path, tokens["gpu-dra-node"], slice_body("other", driver="example.com"))
    assert status == 201
    status, _ = await _http(api, "POST", path, tokens["gpu-dra-publisher"], slice_body("real"))
    assert status == 201
    status, body = await _http(api, "DELETE", f"{path}/real", tokens["gpu-dra-node"])
    assert status == 403 and "not by system:serviceaccount:gpu-dra:gpu-dra-node" in body["message"]
    assert (await _http(api, "GET", f"{path}/real", api.token))[0] == 200


async def test_size_limits(api: RunningApiServer) -> None:
    big = {"metadata": {"name": "big"}, "data": {"blob": "x" * (1024 * 1024 + 1)}}
    status, body = await _http(api, "POST", "/api/v1/namespaces/default/configmaps", api.token, big)
    assert status == 422 and body["reason"] == "Invalid"
    assert body["message"] == 'ConfigMap "big" is invalid: []: Too long: must have at most 1048576 bytes'
    status, body = await _http(
        api,
        "POST",
        "/api/v1/namespaces/default/configmaps",
        api.token,
        raw=b'{"metadata":{"name":"huge"},"data":{"a":"' + b"x" * (3 * 1024 * 1024) + b'"}}',
    )
    assert status == 413 and body["reason"] == "RequestEntityTooLarge"
    assert body["message"] == "Request entity too large: limit is 3145728"
    assert (await _http(api, "GET", "/api/v1/namespaces/default/configmaps/big", api.token))[0] == 404
    ok = {"metadata": {"name": "ok"}, "data": {"blob": "x" * (1024 * 1024 - 10)}}
    assert (await _http(api, "POST", "/api/v1/namespaces/default/configmaps", api.token, ok))[0] == 201


async def test_an_object_over_the_etcd_limit_is_refused_and_not_stored(api: RunningApiServer) -> None:
    event = {
        "metadata": {"name": "loud"},
        "involvedObject": {"kind": "Node", "name": "n"},
        "reason": "Loud",
        "message": "x" * (1536 * 1024 + 1),
    }
    status, body = await _http(api, "POST", "/api/v1/namespaces/default/events", api.token, event)
    assert status == 413 and body["message"] == "etcdserver: request is too large"
    assert (await _http(api, "GET", "/api/v1/namespaces/default/events/loud", api.token))[0] == 404


def test_token_file_lines_are_checked_and_a_bad_file_stops_the_server(tmp_path: Path) -> None:
    import subprocess
    import sys

    from embedded.apiserver.authn import TokenFileError, parse_token_file

    users = parse_token_file('# comment\nt1,bob,7\nt2,carol,8,"a, b"\n')
    assert users["t1"].groups == ("system:authenticated",)
    assert users["t2"].username == "carol" and users["t2"].groups == ("a", "b", "system:authenticated")
    with pytest.raises(TokenFileError, match="line 1: expected token,user,uid"):
        parse_token_file("only-a-token\n")
    with pytest.raises(TokenFileError, match="line 2: the token of 'eve' is already used by 'bob'"):
        parse_token_file("t1,bob,7\nt1,eve,9\n")
    bad = tmp_path / "tokens.csv"
    bad.write_text("t1,bob\n")
    done = subprocess.run(
        [sys.executable, "-m", "shared.cli", "apiserver", "--port", "0", "--token-auth-file", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2
    assert "--token-auth-file" in done.stderr and "line 1: expected token,user,uid" in done.stderr


async def test_policy_variables_namespace_selector_and_failure_policy(api: RunningApiServer) -> None:
    await _admin(api, "POST", "/api/v1/namespaces", {"metadata": {"name": "prod", "labels": {"env": "prod"}}})
    await _admin(
        api,
        "POST",
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
        {
            "metadata": {"name": "small-configmaps"},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE", "UPDATE"],
                            "resources": ["configmaps"],
                        }
                    ],
                    "namespaceSelector": {"matchLabels": {"env": "prod"}},
                },
                "variables": [
                    {"name": "keys", "expression": "object.data.size()"},
                    {"name": "limit", "expression": "2"},
                ],
                "validations": [
                    {"expression": "variables.keys <= variables.limit", "message": "at most two keys in prod"},
                    {"expression": "object.data.missing == 'x'"},
                ],
            },
        },
    )
    await _admin(
        api,
        "POST",
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
        {
            "metadata": {"name": "small-configmaps-prod"},
            "spec": {"policyName": "small-configmaps", "validationActions": ["Deny"]},
        },
    )
    three = {"metadata": {"name": "three"}, "data": {"a": "1", "b": "2", "c": "3"}}
    status, body = await _http(api, "POST", "/api/v1/namespaces/prod/configmaps", api.token, three)
    assert status == 422 and body["reason"] == "Invalid"
    assert body["message"] == (
        "configmaps \"three\" is forbidden: ValidatingAdmissionPolicy 'small-configmaps' "
        "with binding 'small-configmaps-prod' denied request: at most two keys in prod"
    )
    # Outside the selected namespaces the policy does not apply.
    assert (await _http(api, "POST", "/api/v1/namespaces/default/configmaps", api.token, three))[0] == 201
    # An expression that fails at run time denies under failurePolicy Fail.
    two = {"metadata": {"name": "two"}, "data": {"a": "1", "b": "2"}}
    status, body = await _http(api, "POST", "/api/v1/namespaces/prod/configmaps", api.token, two)
    assert status == 422 and "expression 'object.data.missing == 'x'' resulted in error" in body["message"]
    assert (await _http(api, "GET", "/api/v1/namespaces/prod/configmaps/two", api.token))[0] == 404


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
async def test_kubectl_create_token_gives_a_working_service_account_token(
    api: RunningApiServer, tmp_path: Path
) -> None:
    cache = tmp_path / "kubectl-cache"
    rc, _, err = await _kubectl(api.kubeconfig_path, cache, "create", "serviceaccount", "bot")
    assert rc == 0, err
    rc, out, err = await _kubectl(api.kubeconfig_path, cache, "create", "token", "bot", "--duration", "1h")
    assert rc == 0, err
    bot = api.server.write_kubeconfig(tmp_path / "bot.kubeconfig", token=out.strip())
    rc, out, _ = await _kubectl(bot, cache, "auth", "can-i", "get", "configmaps")
    assert (rc, out.strip()) == (1, "no")
    rc, _, err = await _kubectl(bot, cache, "get", "configmaps")
    assert rc == 1 and 'User "system:serviceaccount:default:bot" cannot list resource "configmaps"' in err


async def test_token_review_of_pod_bound_tokens(api: RunningApiServer) -> None:
    """TokenReview as upstream answers it: a token bound to a scheduled pod authenticates with the
    pod's and node's names and uids in user.extra, for the audiences it was issued for only; the
    caller needs `create tokenreviews`; a token for the API server's audience only is not for `nats`,
    and a token for `nats` is not accepted by the API server."""
    await _admin(api, "POST", "/api/v1/namespaces/default/serviceaccounts", {"metadata": {"name": "agent"}})
    await _admin(api, "POST", "/api/v1/nodes", {"metadata": {"name": "gpu-a"}})
    pod = await _admin(
        api,
        "POST",
        "/api/v1/namespaces/default/pods",
        {
            "metadata": {"name": "agent-x"},
            "spec": {"nodeName": "gpu-a", "serviceAccountName": "agent", "containers": [{"name": "c", "image": "i"}]},
        },
    )
    uid = pod["metadata"]["uid"]
    issued = await _admin(
        api,
        "POST",
        "/api/v1/namespaces/default/serviceaccounts/agent/token",
        {
            "spec": {
                "audiences": ["nats"],
                "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "agent-x", "uid": uid},
            }
        },
    )
    token = issued["status"]["token"]

    review = await _admin(
        api,
        "POST",
        "/apis/authentication.k8s.io/v1/tokenreviews",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": ["nats"]},
        },
    )
    status = review["status"]
    assert status["authenticated"] is True and status["audiences"] == ["nats"]
    assert status["user"]["username"] == "system:serviceaccount:default:agent"
    extra = status["user"]["extra"]
    assert extra["authentication.kubernetes.io/pod-name"] == ["agent-x"]
    assert extra["authentication.kubernetes.io/pod-uid"] == [uid]
    assert extra["authentication.kubernetes.io/node-name"] == ["gpu-a"]
    assert extra["authentication.kubernetes.io/credential-id"][0].startswith("JTI=")

    other = await _admin(api, "POST", "/apis/authentication.k8s.io/v1/tokenreviews", {"spec": {"token": token}})
    assert other["status"]["authenticated"] is False and "audiences" in other["status"]["error"]
    # The API server itself takes only tokens for its own audience.
    assert (await _http(api, "GET", "/api/v1/namespaces/default/pods", token))[0] == 401
    # Only a caller allowed `create tokenreviews` may ask.
    status_code, body = await _http(
        api, "POST", "/apis/authentication.k8s.io/v1/tokenreviews", ALICE, {"spec": {"token": token}}
    )
    assert status_code == 403 and body["message"] == (
        'tokenreviews.authentication.k8s.io is forbidden: User "alice" cannot create resource "tokenreviews" '
        'in API group "authentication.k8s.io" at the cluster scope'
    )
    # The pod's deletion ends the token.
    await _admin(api, "DELETE", "/api/v1/namespaces/default/pods/agent-x?gracePeriodSeconds=0")
    gone = await _admin(
        api, "POST", "/apis/authentication.k8s.io/v1/tokenreviews", {"spec": {"token": token, "audiences": ["nats"]}}
    )
    assert gone["status"]["authenticated"] is False and "agent-x" in gone["status"]["error"]
