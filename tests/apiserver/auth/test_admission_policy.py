"""ValidatingAdmissionPolicy in the embedded API server: deploy/'s policy lets only the publisher write
the driver's ResourceSlices, and a policy's variables, namespace selector and failure policy work as
upstream's do."""

from __future__ import annotations

import yaml

from embedded.apiserver.testing import RunningApiServer
from embedded.cluster.apply import Applier
from tests.apiserver.auth.conftest import REPO, _admin, _http
from tests.apiserver.test_crud import slice_body

ADMISSION = REPO / "deploy/kubernetes/base/admission.yaml"


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
