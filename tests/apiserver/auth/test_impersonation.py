"""Impersonation in the embedded API server as a real one does it: the Impersonate-* headers (`kubectl
--as`, `--as-group`, `--as-uid`) act as the named user once the caller may impersonate them, with
upstream's refusals otherwise, and `kubectl auth can-i --as`."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedded.apiserver.testing import RunningApiServer
from tests.apiserver.auth.conftest import ALICE, _admin, _grant_alice_pod_reading, _http, _kubectl
from tests.apiserver.conftest import KUBECTL


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
