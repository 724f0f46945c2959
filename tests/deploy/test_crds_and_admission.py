"""The shipped CRDs accept well-formed ComputeDomain objects and refuse malformed ones (checked
against their openAPIV3Schema with jsonschema), and the ValidatingAdmissionPolicy lets only the
publisher write our drivers' ResourceSlices (its CEL evaluated with a CEL implementation)."""

from __future__ import annotations

import copy
from typing import Any

import cel
import jsonschema
import pytest
import yaml

from tests.deploy.conftest import KUBERNETES, find, render_overlay

CRDS = KUBERNETES / "base" / "crds"

COMPUTE_DOMAIN: dict[str, Any] = {
    "apiVersion": "resource.nvidia.com/v1beta1",
    "kind": "ComputeDomain",
    "metadata": {"name": "imex-job", "namespace": "default"},
    "spec": {
        "numNodes": 0,
        "channel": {"resourceClaimTemplate": {"name": "imex-channel-0"}, "allocationMode": "Single"},
    },
    "status": {
        "status": "Ready",
        "nodes": [{"name": "gb200-0", "ipAddress": "10.0.0.4", "cliqueID": "0f1e.1", "index": 0, "status": "Ready"}],
    },
}
CLIQUE: dict[str, Any] = {
    "apiVersion": "resource.nvidia.com/v1beta1",
    "kind": "ComputeDomainClique",
    "metadata": {"name": "5b3c-uid.0f1e.1", "namespace": "gpu-dra"},
    "daemons": [
        {"nodeName": "gb200-0", "ipAddress": "10.0.0.4", "cliqueID": "0f1e.1", "index": 0, "status": "NotReady"}
    ],
}


def _schema(file: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / file).read_text())
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1beta1" and version["served"] and version["storage"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _errors(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


def test_a_well_formed_compute_domain_and_clique_validate() -> None:
    assert _errors(_schema("computedomains.yaml"), COMPUTE_DOMAIN) == []
    assert _errors(_schema("computedomaincliques.yaml"), CLIQUE) == []


def _broken(obj: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    target = out
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "complaint"),
    [
        (["spec", "channel", "allocationMode"], "Some", "is not one of"),
        (["spec", "channel"], KeyError, "'channel' is a required property"),
        (["spec", "channel", "resourceClaimTemplate"], {}, "'name' is a required property"),
        (["spec", "numNodes"], -1, "less than the minimum"),
        (["status", "status"], "Maybe", "is not one of"),
        (["status", "nodes"], [{"name": "n"}], "'cliqueID' is a required property"),
    ],
)
def test_malformed_compute_domains_are_refused(path: list[str], value: Any, complaint: str) -> None:
    errors = _errors(_schema("computedomains.yaml"), _broken(COMPUTE_DOMAIN, path, value))
    assert any(complaint in e for e in errors), errors


def test_a_clique_daemon_without_node_name_is_refused() -> None:
    errors = _errors(
        _schema("computedomaincliques.yaml"), _broken(CLIQUE, ["daemons"], [{"ipAddress": "x", "cliqueID": ""}])
    )
    assert any("'nodeName' is a required property" in e for e in errors), errors


def test_compute_domain_spec_is_immutable_and_status_is_a_subresource() -> None:
    crd = yaml.safe_load((CRDS / "computedomains.yaml").read_text())
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["x-kubernetes-validations"] == [
        {"message": "A computeDomain.spec is immutable", "rule": "self == oldSelf"}
    ]
    nodes = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["nodes"]
    assert (nodes["x-kubernetes-list-type"], nodes["x-kubernetes-list-map-keys"]) == ("map", ["name"])


# --- the ValidatingAdmissionPolicy -----------------------------------------------------------

PUBLISHER = "system:serviceaccount:gpu-dra:gpu-dra-publisher"
NODE_AGENT = "system:serviceaccount:gpu-dra:gpu-dra-node"
GC = "system:serviceaccount:kube-system:generic-garbage-collector"


def _admit(operation: str, user: str, groups: list[str], driver: str = "gpu.nvidia.com") -> bool | None:
    """None when the policy does not apply; else whether it admits the request."""
    policy = find(render_overlay("production"), "ValidatingAdmissionPolicy", "gpu-dra-resourceslices")["spec"]
    slice_obj = {"spec": {"driver": driver, "nodeName": "gpu-a", "pool": {"name": "gpu-a"}}}
    context: dict[str, Any] = {
        "request": {"operation": operation, "userInfo": {"username": user, "groups": groups}},
        "object": None if operation == "DELETE" else slice_obj,
        "oldObject": slice_obj if operation != "CREATE" else None,
    }
    if not all(cel.evaluate(m["expression"], context) for m in policy["matchConditions"]):
        return None
    context["variables"] = {v["name"]: cel.evaluate(v["expression"], context) for v in policy["variables"]}
    admitted = all(cel.evaluate(v["expression"], context) for v in policy["validations"])
    if not admitted:
        message = cel.evaluate(policy["validations"][0]["messageExpression"], context)
        assert user in message and driver in message, message
    return admitted


def test_admission_policy_is_bound_in_deny_mode() -> None:
    binding = find(render_overlay("production"), "ValidatingAdmissionPolicyBinding", "gpu-dra-resourceslices")
    assert binding["spec"] == {"policyName": "gpu-dra-resourceslices", "validationActions": ["Deny"]}


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_the_publisher_may_write_slices(operation: str) -> None:
    assert _admit(operation, PUBLISHER, ["system:serviceaccounts"]) is True


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_a_node_agent_or_admin_may_not_write_our_slices(operation: str) -> None:
    assert _admit(operation, NODE_AGENT, ["system:serviceaccounts"]) is False
    assert _admit(operation, "alice", ["system:authenticated"], driver="compute-domain.nvidia.com") is False


def test_kubelet_and_garbage_collector_may_only_delete() -> None:
    assert _admit("DELETE", "system:node:gpu-a", ["system:nodes"]) is True
    assert _admit("DELETE", GC, ["system:serviceaccounts"]) is True
    assert _admit("CREATE", "system:node:gpu-a", ["system:nodes"]) is False
    assert _admit("UPDATE", GC, ["system:serviceaccounts"]) is False


def test_other_drivers_slices_are_not_our_business() -> None:
    assert _admit("CREATE", "alice", [], driver="example.com") is None
