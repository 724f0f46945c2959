"""Validation as the real API server does it: upstream schemas, resource.k8s.io rules, metadata,
immutability, CRD structural schemas, and the 422 Status shape."""

from __future__ import annotations

import copy
import glob
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from embedded.apiserver.validation import (
    UNKNOWN_FIELD,
    FieldError,
    invalid_status,
    prune_unknown,
    strict_decoding_message,
    unknown_fields,
    validate_custom,
    validate_object,
)

WORKLOADS = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "workloads"
COMPUTEDOMAIN_CRD = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "computedomain-crd.yaml"


def h100_device(minor: int, extra_attributes: int = 0) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "type": {"string": "gpu"},
        "uuid": {"string": f"GPU-4404041a-04cf-1ccf-9e70-f139a9b1e{minor:03d}"},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "brand": {"string": "Nvidia"},
        "architecture": {"string": "Hopper"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "driverVersion": {"version": "570.158.1"},
        "cudaDriverVersion": {"version": "12.8.0"},
        "resource.kubernetes.io/pciBusID": {"string": f"0000:{0x18 + minor:02x}:00.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:17"},
    }
    for i in range(extra_attributes):
        attributes[f"extra{i}"] = {"int": i}
    return {"name": f"gpu-{minor}", "attributes": attributes, "capacity": {"memory": {"value": "80Gi"}}}


def h100_slice(devices: int = 8, extra_attributes: int = 0) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "name": "node-1-gpu.nvidia.com-x7k2p",
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": "node-1",
                    "uid": "8c7a3f4e-0000-4000-8000-000000000001",
                    "controller": True,
                }
            ],
        },
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "node-1",
            "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
            "devices": [h100_device(i, extra_attributes) for i in range(devices)],
        },
    }


def claim() -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "gpu-claim", "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.nvidia.com",
                            "count": 1,
                            "selectors": [
                                {
                                    "cel": {
                                        "expression": "device.attributes['gpu.nvidia.com'].productName "
                                        "== 'NVIDIA H100 80GB HBM3'"
                                    }
                                }
                            ],
                        },
                    },
                    {
                        "name": "mig",
                        "firstAvailable": [
                            {"name": "big", "deviceClassName": "mig.nvidia.com"},
                            {"name": "small", "deviceClassName": "mig.nvidia.com", "count": 2},
                        ],
                    },
                ],
                "constraints": [{"requests": ["gpu", "mig/big"], "matchAttribute": "gpu.nvidia.com/parentUUID"}],
                "config": [
                    {
                        "requests": ["gpu"],
                        "opaque": {
                            "driver": "gpu.nvidia.com",
                            "parameters": {
                                "apiVersion": "resource.nvidia.com/v1beta1",
                                "kind": "GpuConfig",
                                "sharing": {"strategy": "TimeSlicing"},
                            },
                        },
                    }
                ],
            }
        },
    }


def fields(errors: list[FieldError]) -> dict[str, str]:
    return {e.field: e.type for e in errors}


def slice_errors(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[FieldError]:
    return validate_object("resource.k8s.io", "v1", "ResourceSlice", obj, old)


# -- ResourceSlice ----------------------------------------------------------------------------------


def test_h100_slice_is_valid() -> None:
    assert slice_errors(h100_slice()) == []


def test_129_devices_is_too_many_at_spec_devices() -> None:
    errors = slice_errors(h100_slice(devices=129))
    assert [(e.type, e.field) for e in errors] == [("FieldValueTooMany", "spec.devices")]
    assert str(errors[0]) == "spec.devices: Too many: 129: must have at most 128 items"
    assert slice_errors(h100_slice(devices=128)) == []


def test_taints_lower_the_device_limit_to_64() -> None:
    obj = h100_slice(devices=65)
    obj["spec"]["devices"][0]["taints"] = [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]
    assert fields(slice_errors(obj)) == {"spec.devices": "FieldValueTooMany"}


def test_33_attributes_and_capacities_are_too_many() -> None:
    obj = h100_slice(devices=2, extra_attributes=22)  # 10 + 22 attributes + 1 capacity = 33
    errors = slice_errors(obj)
    assert fields(errors) == {"spec.devices[0]": "FieldValueInvalid", "spec.devices[1]": "FieldValueInvalid"}
    assert "must not exceed 32" in errors[0].message and errors[0].value == 33
    assert slice_errors(h100_slice(devices=2, extra_attributes=21)) == []


@pytest.mark.parametrize(
    ("mutate", "field", "kind"),
    [
        (lambda s: s["spec"]["devices"][0].update(name="GPU_0"), "spec.devices[0].name", "FieldValueInvalid"),
        (lambda s: s["spec"]["devices"][1].update(name="gpu-0"), "spec.devices[1]", "FieldValueDuplicate"),
        (lambda s: s["spec"].update(driver="GPU.nvidia.com!"), "spec.driver", "FieldValueInvalid"),
        (lambda s: s["spec"]["pool"].update(name="node_1"), "spec.pool.name", "FieldValueInvalid"),
        (
            lambda s: s["spec"]["devices"][0]["attributes"].update({"bad-key": {"int": 1}}),
            "spec.devices[0].attributes[bad-key]",
            "FieldValueInvalid",
        ),
        (
            lambda s: s["spec"]["devices"][0]["attributes"].update({"Bad_Domain/ok": {"int": 1}}),
            "spec.devices[0].attributes[Bad_Domain/ok]",
            "FieldValueInvalid",
        ),
        (
            lambda s: s["spec"]["devices"][0]["attributes"].update(driverVersion={"version": "v570"}),
            "spec.devices[0].attributes[driverVersion].version",
            "FieldValueInvalid",
        ),
        (
            lambda s: s["spec"]["devices"][0]["attributes"].update(brand={"string": "x" * 65}),
            "spec.devices[0].attributes[brand].string",
            "FieldValueTooLong",
        ),
        (
            lambda s: s["spec"]["devices"][0]["attributes"].update(brand={"string": "a", "int": 1}),
            "spec.devices[0].attributes[brand]",
            "FieldValueInvalid",
        ),
        (
            lambda s: s["spec"]["devices"][0]["attributes"].update(numa={"int": None}),
            "spec.devices[0].attributes[numa]",
            "FieldValueInvalid",
        ),
        (
            lambda s: s["spec"]["devices"][0]["attributes"].update(brand={}),
            "spec.devices[0].attributes[brand]",
            "FieldValueInvalid",
        ),
        (
            lambda s: s["spec"]["devices"][0]["attributes"].update({"x" * 33: {"int": 1}}),
            "spec.devices[0].attributes[" + "x" * 33 + "]",
            "FieldValueTooLong",
        ),
        (lambda s: s["spec"].update(nodeName="", allNodes=True), "spec.nodeName", "FieldValueInvalid"),
        (lambda s: s["spec"].update(allNodes=False), "spec.allNodes", "FieldValueInvalid"),
        (
            lambda s: s["spec"]["devices"][0]["capacity"]["memory"].update(requestPolicy={"default": "1Gi"}),
            "spec.devices[0].capacity[memory].requestPolicy",
            "FieldValueForbidden",
        ),
        (
            lambda s: s["spec"]["devices"][0]["capacity"].update(memory={"value": "80 GB"}),
            "spec.devices[0].capacity[memory].value",
            "FieldValueInvalid",
        ),
        (lambda s: s["metadata"].update(name="Node-1"), "metadata.name", "FieldValueInvalid"),
        (lambda s: s["spec"]["pool"].update(resourceSliceCount=0), "spec.pool.resourceSliceCount", "FieldValueInvalid"),
    ],
)
def test_bad_names_and_values_are_reported_at_their_field(mutate: Any, field: str, kind: str) -> None:
    obj = h100_slice(devices=2)
    mutate(obj)
    errors = slice_errors(obj)
    assert fields(errors) == {field: kind}, [str(e) for e in errors]


def test_exactly_one_node_selection_field() -> None:
    obj = h100_slice()
    obj["spec"]["allNodes"] = True
    errors = slice_errors(obj)
    assert [(e.type, e.field) for e in errors] == [("FieldValueInvalid", "spec")]
    assert "multiple fields are set" in errors[0].message and "`allNodes`" in str(errors[0].value)
    del obj["spec"]["allNodes"], obj["spec"]["nodeName"]
    errors = slice_errors(obj)
    assert [(e.type, e.field) for e in errors] == [("FieldValueRequired", "spec")]
    obj["spec"]["nodeSelector"] = {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "a", "operator": "In", "values": ["b"]}]},
            {"matchFields": []},
        ]
    }
    assert fields(slice_errors(obj)) == {"spec.nodeSelector.nodeSelectorTerms": "FieldValueInvalid"}


def test_per_device_node_selection() -> None:
    obj = h100_slice(devices=2)
    del obj["spec"]["nodeName"]
    obj["spec"]["perDeviceNodeSelection"] = True
    obj["spec"]["devices"][0]["nodeName"] = "node-1"
    obj["spec"]["devices"][1]["allNodes"] = True
    assert slice_errors(obj) == []
    obj["spec"]["devices"][1]["nodeName"] = "node-2"
    assert fields(slice_errors(obj)) == {"spec.devices[1]": "FieldValueInvalid"}
    plain = h100_slice(devices=1)
    plain["spec"]["devices"][0]["nodeName"] = "node-1"
    errors = slice_errors(plain)
    assert fields(errors) == {"spec.devices[0]": "FieldValueInvalid"}
    assert "can only be set if `perDeviceNodeSelection` is set to true" in errors[0].message


def test_shared_counters_rules() -> None:
    counters = h100_slice(devices=0)
    del counters["spec"]["devices"]
    counters["spec"]["sharedCounters"] = [
        {"name": "gpu-0-counter-set", "counters": {"memory": {"value": "80Gi"}, "memory-slice-0": {"value": "1"}}},
        {"name": "gpu-0-counter-set", "counters": {"multiprocessors": {"value": "132"}}},
    ]
    assert fields(slice_errors(counters)) == {"spec.sharedCounters[1]": "FieldValueDuplicate"}
    counters["spec"]["sharedCounters"][1] = {"name": "gpu-1-counter-set", "counters": {}}
    assert fields(slice_errors(counters)) == {"spec.sharedCounters[1].counters": "FieldValueRequired"}
    both = h100_slice(devices=1)
    both["spec"]["sharedCounters"] = [{"name": "s", "counters": {"memory": {"value": "1"}}}]
    assert fields(slice_errors(both)) == {"spec": "FieldValueInvalid"}


def test_unknown_field_is_an_error_naming_it() -> None:
    obj = h100_slice()
    obj["spec"]["devices"][3]["basic"] = {"attributes": {}}  # the v1beta1 shape sent as v1
    obj["spec"]["nodeNmae"] = "typo"
    errors = slice_errors(obj)
    unknown, other = unknown_fields(errors)
    assert {e.field for e in unknown} == {"spec.devices[3].basic", "spec.nodeNmae"} and other == []
    assert all(e.type == UNKNOWN_FIELD for e in unknown)
    assert 'unknown field "spec.nodeNmae"' in strict_decoding_message("ResourceSlice", "v1", unknown)
    pruned = prune_unknown(obj, unknown)
    assert "nodeNmae" not in pruned["spec"] and "basic" not in pruned["spec"]["devices"][3]
    assert slice_errors(pruned) == [] and "nodeNmae" in obj["spec"]  # the input is untouched


def test_wrong_types_and_missing_required_fields() -> None:
    obj = h100_slice(devices=1)
    obj["spec"]["devices"][0]["attributes"]["numa"] = {"int": "zero"}
    obj["spec"]["pool"]["generation"] = None
    del obj["spec"]["driver"]
    errors = fields(slice_errors(obj))
    assert errors["spec.devices[0].attributes[numa].int"] == "FieldValueTypeInvalid"
    assert errors["spec.driver"] == "FieldValueRequired"
    assert errors["spec.pool.generation"] == "FieldValueRequired"


def test_slice_driver_and_pool_are_immutable() -> None:
    old = h100_slice()
    new = copy.deepcopy(old)
    new["spec"]["devices"].pop()
    new["spec"]["pool"]["generation"] = 2
    assert slice_errors(new, old) == []
    new["spec"]["driver"] = "other.example.com"
    new["spec"]["pool"]["name"] = "node-2"
    new["metadata"]["name"] = "renamed"
    errors = slice_errors(new, old)
    assert fields(errors) == {
        "spec.driver": "FieldValueInvalid",
        "spec.pool.name": "FieldValueInvalid",
        "metadata.name": "FieldValueInvalid",
    }
    assert all(e.message == "field is immutable" for e in errors)


def test_128_device_slice_validates_fast() -> None:
    full = h100_slice(devices=128, extra_attributes=21)  # 32 attributes+capacities on each device
    slice_errors(full)  # schema compiled on first use
    rounds = 20
    start = time.perf_counter()
    for _ in range(rounds):
        assert slice_errors(full) == []
    per_call = (time.perf_counter() - start) / rounds
    print(f"\n128 devices x 32 attributes+capacities: {per_call * 1000:.2f} ms per validation")
    assert per_call < 0.25


# -- ResourceClaim, template, class -----------------------------------------------------------------


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


# -- metadata and other kinds -----------------------------------------------------------------------


def test_metadata_rules() -> None:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    assert fields(validate_object("", "v1", "Pod", pod)) == {"metadata.name": "FieldValueRequired"}
    pod["metadata"]["generateName"] = "worker-"
    assert validate_object("", "v1", "Pod", pod) == []
    pod["metadata"]["labels"] = {"bad key!": "v", "ok": "bad value!"}
    pod["metadata"]["annotations"] = {"example.com/a": "x" * (256 * 1024)}
    assert fields(validate_object("", "v1", "Pod", pod)) == {
        "metadata.labels": "FieldValueInvalid",
        "metadata.labels[ok]": "FieldValueInvalid",
        "metadata.annotations": "FieldValueTooLong",
    }
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a.b"}}
    assert fields(validate_object("", "v1", "Namespace", ns)) == {"metadata.name": "FieldValueInvalid"}


def test_other_builtin_kinds_use_their_schema() -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "x"},
        "spec": {
            "replicas": "three",
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "i", "imagePullPolicy": 1}]},
            },
        },
    }
    assert fields(validate_object("apps", "v1", "Deployment", deployment)) == {
        "spec.replicas": "FieldValueTypeInvalid",
        "spec.template.spec.containers[0].imagePullPolicy": "FieldValueTypeInvalid",
    }
    lease: dict[str, Any] = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "l", "namespace": "x"},
        "spec": {"holderIdentity": "me", "renewTime": "2026-12-03T06:00:00.000000Z", "leaseDurationSeconds": 15},
    }
    assert validate_object("coordination.k8s.io", "v1", "Lease", lease) == []
    lease["spec"]["renewTime"] = "yesterday"
    assert fields(validate_object("coordination.k8s.io", "v1", "Lease", lease)) == {
        "spec.renewTime": "FieldValueInvalid"
    }
    unknown = validate_object("example.com", "v1", "Gadget", {"metadata": {"name": "g"}})
    assert unknown[0].type == "FieldValueNotSupported" and "Gadget" in unknown[0].message


def test_reference_workloads_are_valid() -> None:
    count = 0
    for path in sorted(glob.glob(str(WORKLOADS / "*.yaml"))):
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if not doc:
                continue
            group, _, version = doc["apiVersion"].rpartition("/")
            assert validate_object(group, version, doc["kind"], doc) == [], (path, doc["kind"])
            count += 1
    assert count > 20


# -- custom resources -------------------------------------------------------------------------------

WIDGET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "required": ["size"],
            "properties": {
                "size": {"type": "integer", "minimum": 1, "maximum": 10},
                "color": {"type": "string", "enum": ["red", "blue"]},
                "name": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8},
                "tags": {"type": "array", "maxItems": 2, "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "note": {"type": "string", "nullable": True},
            },
        },
        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}


def widget(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": "w", "namespace": "default"},
        "spec": {"size": 3, **spec},
    }


def test_custom_resource_valid_and_invalid() -> None:
    good = widget(color="red", name="abc", tags=["a"], labels={"x": "y"}, free={"any": {"thing": 1}}, note=None)
    assert validate_custom(WIDGET_SCHEMA, good) == []
    bad = widget(size=11, color="green", name="ABC", tags=["a", "a"], labels={"x": 1}, note=None, extra=True)
    errors = fields(validate_custom(WIDGET_SCHEMA, bad))
    assert errors == {
        "spec.size": "FieldValueInvalid",
        "spec.color": "FieldValueNotSupported",
        "spec.name": "FieldValueInvalid",
        "spec.tags[1]": "FieldValueDuplicate",
        "spec.labels[x]": "FieldValueTypeInvalid",
        "spec.extra": UNKNOWN_FIELD,
    }
    missing = widget()
    del missing["spec"]["size"]
    missing["spec"]["name"] = None
    assert fields(validate_custom(WIDGET_SCHEMA, missing)) == {
        "spec.size": "FieldValueRequired",
        "spec.name": "FieldValueTypeInvalid",
    }


def test_computedomain_crd_and_resource() -> None:
    crd = yaml.safe_load(COMPUTEDOMAIN_CRD.read_text())
    assert validate_object("apiextensions.k8s.io", "v1", "CustomResourceDefinition", crd) == []
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    domain: dict[str, Any] = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": "imex", "namespace": "default"},
        "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "imex-channel"}}},
    }
    assert validate_custom(schema, domain) == []
    resized = copy.deepcopy(domain)
    resized["spec"]["numNodes"] = 3  # the CRD's CEL rule `self == oldSelf` keeps spec immutable
    errors = validate_custom(schema, resized, domain)
    assert [str(e) for e in errors] == ['spec: Invalid value: "object": A computeDomain.spec is immutable']
    assert validate_custom(schema, resized) == []  # a transition rule has nothing to compare on create
    domain["spec"]["channel"]["allocationMode"] = "Some"
    assert fields(validate_custom(schema, domain)) == {"spec.channel.allocationMode": "FieldValueNotSupported"}
    broken = copy.deepcopy(crd)
    broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"][0][
        "rule"
    ] = "self =="
    assert fields(validate_object("apiextensions.k8s.io", "v1", "CustomResourceDefinition", broken)) == {
        "spec.versions[0].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].rule": "FieldValueInvalid"
    }


def test_cel_rules_on_maps_lists_and_reasons() -> None:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "replicas": {
                        "type": "integer",
                        "x-kubernetes-validations": [{"rule": "self <= 5", "message": "at most 5 replicas"}],
                    },
                    "ports": {
                        "type": "array",
                        "x-kubernetes-list-type": "map",
                        "x-kubernetes-list-map-keys": ["name"],
                        "items": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}, "port": {"type": "integer"}},
                            "x-kubernetes-validations": [
                                {
                                    "rule": "self.port == oldSelf.port",
                                    "message": "port is immutable",
                                    "reason": "FieldValueForbidden",
                                }
                            ],
                        },
                    },
                },
                "x-kubernetes-validations": [
                    {
                        "rule": "has(self.replicas)",
                        "fieldPath": ".replicas",
                        "reason": "FieldValueRequired",
                        "message": "replicas is required",
                    }
                ],
            }
        },
    }
    old = widget(replicas=2, ports=[{"name": "a", "port": 1}, {"name": "b", "port": 2}])
    old["spec"].pop("size")
    assert validate_custom(schema, old) == []
    new = copy.deepcopy(old)
    new["spec"]["replicas"] = 9
    new["spec"]["ports"] = [{"name": "b", "port": 3}, {"name": "c", "port": 4}]  # b changed, c is new
    assert [(e.type, e.field, e.message) for e in validate_custom(schema, new, old)] == [
        ("FieldValueInvalid", "spec.replicas", "at most 5 replicas"),
        ("FieldValueForbidden", "spec.ports[0]", "port is immutable"),
    ]
    del new["spec"]["replicas"]
    assert fields(validate_custom(schema, new)) == {"spec.replicas": "FieldValueRequired"}


# -- the 422 Status -------------------------------------------------------------------------------


def test_invalid_status_matches_the_real_server() -> None:
    errors = slice_errors(h100_slice(devices=129))
    status = invalid_status("ResourceSlice.resource.k8s.io", "x", errors)
    assert status == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'ResourceSlice.resource.k8s.io "x" is invalid: '
        "spec.devices: Too many: 129: must have at most 128 items",
        "reason": "Invalid",
        "details": {
            "name": "x",
            "group": "resource.k8s.io",
            "kind": "ResourceSlice",
            "causes": [
                {
                    "reason": "FieldValueTooMany",
                    "message": "Too many: 129: must have at most 128 items",
                    "field": "spec.devices",
                }
            ],
        },
        "code": 422,
    }
    two = [
        FieldError("FieldValueRequired", "metadata.name", "name or generateName is required"),
        FieldError("FieldValueInvalid", "spec.x", "bad", "v"),
    ]
    core = invalid_status("Pod", "p", two)
    assert core["message"] == (
        'Pod "p" is invalid: [metadata.name: Required value: name or generateName is required, '
        'spec.x: Invalid value: "v": bad]'
    )
    assert "group" not in core["details"] and core["details"]["kind"] == "Pod"
