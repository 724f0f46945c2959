"""RBAC in the embedded API server as a real one does it: stored Roles, ClusterRoles and bindings decide
each request (403 with the upstream message), a change takes effect on the very next request, and
`kubectl auth can-i` (SelfSubjectAccessReview) answers as the checks do."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from embedded.apiserver.testing import RunningApiServer
from tests.apiserver.auth.conftest import ALICE, _admin, _grant_alice_pod_reading, _http, _kubectl
from tests.apiserver.conftest import KUBECTL


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
