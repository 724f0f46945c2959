"""ResourceClaim, ResourceClaimTemplate and DeviceClass validation as the real API server does it: the
request forms and their rules, spec immutability, status and allocation rules, and v1beta1 objects
reported at their internal v1 fields."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from embedded.apiserver.validation import UNKNOWN_FIELD, FieldError, validate_object
from tests.apiserver.validation_objects import claim, fields


def claim_errors(obj: dict[str, Any], old: dict[str, Any] | None = None, version: str = "v1") -> list[FieldError]:
    return validate_object("resource.k8s.io", version, "ResourceClaim", obj, old)


def test_realistic_claim_is_valid() -> None:
    assert claim_errors(claim()) == []


def test_request_needs_exactly_one_of_exactly_and_first_available() -> None:
    obj = claim()
    obj["spec"]["devices"]["requests"][1]["exactly"] = {"deviceClassName": "gpu.nvidia.com"}
    obj["spec"]["devices"]["requests"].append({"name": "empty"})
    errors = claim_errors(obj)
    assert fields(errors) == {
        "spec.devices.requests[1]": "FieldValueInvalid",
        "spec.devices.requests[2]": "FieldValueRequired",
    }


@pytest.mark.parametrize(
    ("mutate", "field", "kind"),
    [
        (
            lambda d: d["requests"][0]["exactly"].update(count=0),
            "spec.devices.requests[0].exactly.count",
            "FieldValueInvalid",
        ),
        (
            lambda d: d["requests"][0]["exactly"].update(allocationMode="Some"),
            "spec.devices.requests[0].exactly.allocationMode",
            "FieldValueNotSupported",
        ),
        (
            lambda d: d["requests"][0]["exactly"].update(deviceClassName="GPU Class"),
            "spec.devices.requests[0].exactly.deviceClassName",
            "FieldValueInvalid",
        ),
        (
            lambda d: d["requests"].append({"name": "my_gpu", "exactly": {"deviceClassName": "c"}}),
            "spec.devices.requests[2].name",
            "FieldValueInvalid",
        ),
        (
            lambda d: (d["requests"][1]["firstAvailable"].clear(), d.pop("constraints")),
            "spec.devices.requests[1]",
            "FieldValueRequired",
        ),
        (
            lambda d: d["constraints"][0].update(requests=["nope"]),
            "spec.devices.constraints[0].requests[0]",
            "FieldValueInvalid",
        ),
        (
            lambda d: d["constraints"][0].update(matchAttribute="parentUUID"),
            "spec.devices.constraints[0].matchAttribute",
            "FieldValueInvalid",
        ),
        (
            lambda d: d["config"][0]["opaque"].update(parameters={"blob": "x" * 11000}),
            "spec.devices.config[0].opaque.parameters",
            "FieldValueTooLong",
        ),
        (
            lambda d: d["config"][0]["opaque"].pop("driver"),
            "spec.devices.config[0].opaque.driver",
            "FieldValueRequired",
        ),
        (
            lambda d: d["requests"][0]["exactly"].update(
                tolerations=[{"key": "a", "operator": "Exists", "value": "b"}]
            ),
            "spec.devices.requests[0].exactly.tolerations[0].operator",
            "FieldValueInvalid",
        ),
        (
            lambda d: d["requests"][0]["exactly"]["selectors"].append({"cel": {"expression": "device.driver =="}}),
            "spec.devices.requests[0].exactly.selectors[1].cel.expression",
            "FieldValueInvalid",
        ),
        (
            lambda d: d["requests"].extend({"name": f"r{i}", "exactly": {"deviceClassName": "c"}} for i in range(31)),
            "spec.devices.requests",
            "FieldValueTooMany",
        ),
    ],
)
def test_claim_rules(mutate: Any, field: str, kind: str) -> None:
    obj = claim()
    mutate(obj["spec"]["devices"])
    errors = claim_errors(obj)
    assert fields(errors) == {field: kind}, [str(e) for e in errors]


def test_claim_spec_is_immutable_but_status_and_labels_may_change() -> None:
    old = claim()
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"app": "x"}
    new["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0"}]
            }
        },
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "u-1"}],
    }
    assert claim_errors(new, old) == []
    new["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    errors = claim_errors(new, old)
    assert [(e.type, e.field, e.message) for e in errors] == [("FieldValueInvalid", "spec", "field is immutable")]


def allocated(claim_obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(claim_obj)
    out["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0"},
                    {
                        "request": "mig/big",
                        "driver": "gpu.nvidia.com",
                        "pool": "node-1",
                        "device": "gpu-1-mig-3g40gb-0",
                    },
                ]
            }
        },
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "u-1"}],
        "devices": [
            {
                "driver": "gpu.nvidia.com",
                "pool": "node-1",
                "device": "gpu-0",
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "Prepared",
                        "message": "",
                        "lastTransitionTime": "2026-12-03T06:00:00Z",
                    }
                ],
                "networkData": {"interfaceName": "eth1", "ips": ["10.9.8.7/24"]},
            }
        ],
    }
    return out


def test_claim_status_rules() -> None:
    good = allocated(claim())
    assert claim_errors(good) == []
    bad = copy.deepcopy(good)
    bad["status"]["allocation"]["devices"]["results"][1]["request"] = "mig/huge"
    bad["status"]["devices"].append({"driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-7"})
    bad["status"]["devices"][0]["networkData"]["ips"] = ["10.9.8.7"]
    bad["status"]["reservedFor"].append({"resource": "pods", "name": "q", "uid": "u-1"})
    assert fields(claim_errors(bad)) == {
        "status.allocation.devices.results[1].request": "FieldValueInvalid",
        "status.devices[1]": "FieldValueInvalid",
        "status.devices[0].networkData.ips[0]": "FieldValueInvalid",
        "status.reservedFor[1]": "FieldValueDuplicate",
    }
    unallocated = copy.deepcopy(good)
    del unallocated["status"]["allocation"], unallocated["status"]["devices"]
    assert fields(claim_errors(unallocated)) == {"status.reservedFor": "FieldValueForbidden"}


def test_an_allocation_can_be_cleared_but_not_changed() -> None:
    old = allocated(claim())
    changed = copy.deepcopy(old)
    changed["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-3"
    changed["status"]["devices"][0]["device"] = "gpu-3"
    assert fields(claim_errors(changed, old)) == {"status.allocation": "FieldValueInvalid"}
    cleared = copy.deepcopy(old)
    cleared["status"] = {}
    assert claim_errors(cleared, old) == []


def test_v1beta1_errors_name_the_internal_v1_fields_like_the_real_server() -> None:
    # The real server validates its internal (v1-shaped) object, so DRA-rule errors on a v1beta1
    # object name the v1 fields; schema errors (unknown fields) name what was sent.
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com", "count": -1}]}},
    }
    assert fields(claim_errors(obj, version="v1beta1")) == {
        "spec.devices.requests[0].exactly.count": "FieldValueInvalid"
    }
    obj["spec"]["devices"]["requests"][0]["exactly"] = {"deviceClassName": "x"}  # a v1 field sent as v1beta1
    assert fields(claim_errors(obj, version="v1beta1"))["spec.devices.requests[0].exactly"] == UNKNOWN_FIELD
    beta_slice: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceSlice",
        "metadata": {"name": "s"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "n",
            "pool": {"name": "n", "generation": 0, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "basic": {"attributes": {"bad key": {"int": 1}}}}],
        },
    }
    errors = validate_object("resource.k8s.io", "v1beta1", "ResourceSlice", beta_slice)
    assert fields(errors) == {"spec.devices[0].attributes[bad key]": "FieldValueInvalid"}
    assert (
        validate_object(
            "resource.k8s.io",
            "v1beta1",
            "ResourceSlice",
            beta_slice
            | {
                "spec": {
                    **beta_slice["spec"],
                    "devices": [{"name": "gpu-0", "basic": {"attributes": {"ok": {"int": 1}}}}],
                }
            },
        )
        == []
    )


def test_template_and_class() -> None:
    template: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {"metadata": {"labels": {"a": "b"}}, "spec": claim()["spec"]},
    }
    assert validate_object("resource.k8s.io", "v1", "ResourceClaimTemplate", template) == []
    changed = copy.deepcopy(template)
    changed["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "BAD"
    assert fields(validate_object("resource.k8s.io", "v1", "ResourceClaimTemplate", changed)) == {
        "spec.spec.devices.requests[0].exactly.deviceClassName": "FieldValueInvalid"
    }
    assert "spec" in fields(
        validate_object(
            "resource.k8s.io", "v1", "ResourceClaimTemplate", copy.deepcopy(template) | {"spec": {"spec": {}}}, template
        )
    )
    device_class: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "gpu.nvidia.com"},
        "spec": {
            "selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}],
            "extendedResourceName": "nvidia.com/gpu",
        },
    }
    assert validate_object("resource.k8s.io", "v1", "DeviceClass", device_class) == []
    device_class["spec"]["selectors"].append({"cel": {"expression": ""}})
    assert fields(validate_object("resource.k8s.io", "v1", "DeviceClass", device_class)) == {
        "spec.selectors[1].cel.expression": "FieldValueRequired"
    }
