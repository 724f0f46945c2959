"""ResourceSlice validation as the real API server does it: device and attribute limits, names and
values reported at their field, node selection, shared counters, unknown fields, immutability, and the
time to validate a full 128-device slice."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

from embedded.apiserver.validation import UNKNOWN_FIELD, prune_unknown, strict_decoding_message, unknown_fields
from tests.apiserver.validation_objects import fields, h100_slice, slice_errors


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
