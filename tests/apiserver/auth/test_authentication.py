"""Authentication in the embedded API server as a real one does it: static tokens from a token file (its
lines checked, a bad file stops the server) and ServiceAccount tokens from the TokenRequest API and
`kubectl create token` (401 for anything else, or once the account is gone), and TokenReview of
pod-bound tokens with their audiences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.apiserver.testing import RunningApiServer
from tests.apiserver.auth.conftest import ALICE, REPO, _admin, _http, _kubectl
from tests.apiserver.conftest import KUBECTL


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
