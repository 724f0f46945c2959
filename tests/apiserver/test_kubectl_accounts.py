"""Accounts as kubectl users meet them: a `default` ServiceAccount in every namespace, `kubectl create token`,
`kubectl auth whoami` (SelfSubjectReview), and the generated selector of a Job."""

from __future__ import annotations

import json

from embedded.apiserver.testing import RunningApiServer
from tests.apiserver.conftest import Kubectl


async def test_every_namespace_has_a_default_service_account(kubectl: Kubectl) -> None:
    for ns in ("default", "kube-system"):
        _, out, _ = await kubectl("get", "serviceaccount", "default", "-n", ns, "-o", "name")
        assert out.strip() == "serviceaccount/default"
    await kubectl("create", "namespace", "team")
    _, out, _ = await kubectl("get", "serviceaccount", "default", "-n", "team", "-o", "name")
    assert out.strip() == "serviceaccount/default"
    await kubectl("delete", "serviceaccount", "default", "-n", "team")  # made again, as the controller does
    _, out, _ = await kubectl("get", "serviceaccount", "-n", "team", "-o", "jsonpath={.items[*].metadata.name}")
    assert out == "default"
    await kubectl("create", "namespace", "dry", "--dry-run=server")
    code, _, err = await kubectl("get", "serviceaccount", "default", "-n", "dry", check=False)
    assert code == 1 and "NotFound" in err


async def test_a_token_for_the_default_account_says_who_it_is(kubectl: Kubectl, api: RunningApiServer) -> None:
    await kubectl("create", "namespace", "team")
    _, token, _ = await kubectl("create", "token", "default", "-n", "team")
    _, me, _ = await kubectl("auth", "whoami", "-o", "json")
    assert json.loads(me)["status"]["userInfo"]["username"] == "kubernetes-admin"
    _, me, _ = await kubectl("--token", token.strip(), "auth", "whoami", "-o", "json")
    info = json.loads(me)["status"]["userInfo"]
    assert info["username"] == "system:serviceaccount:team:default"
    assert {"system:serviceaccounts", "system:serviceaccounts:team", "system:authenticated"} <= set(info["groups"])
    code, _, err = await kubectl("--token", token.strip(), "get", "pods", "-n", "team", check=False)
    assert code == 1 and 'User "system:serviceaccount:team:default" cannot list resource "pods"' in err


async def test_a_job_selects_its_own_pods_by_uid(kubectl: Kubectl) -> None:
    await kubectl("create", "job", "once", "--image=busybox", "--", "echo", "hi")
    _, out, _ = await kubectl("get", "job", "once", "-o", "json")
    job = json.loads(out)
    uid = job["metadata"]["uid"]
    assert job["spec"]["selector"] == {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
    assert job["spec"]["template"]["metadata"]["labels"] == {
        "batch.kubernetes.io/controller-uid": uid,
        "batch.kubernetes.io/job-name": "once",
        "controller-uid": uid,
        "job-name": "once",
    }
