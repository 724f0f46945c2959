"""resource.k8s.io v1 <-> v1beta1 conversion: lossless round trips of realistic objects, each
converted object valid against the upstream schema of its new version."""

from __future__ import annotations

import copy
import glob
from pathlib import Path
from typing import Any

import pytest
import yaml

from embedded.apiserver.conversion import (
    STORAGE_VERSION,
    ConversionError,
    convert_resource,
    v1_field_path_to,
)
from embedded.apiserver.validation import validate_object
from tests.apiserver.validation_objects import claim, h100_slice

WORKLOADS = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "workloads"


def assert_valid(obj: dict[str, Any]) -> None:
    group, _, version = obj["apiVersion"].rpartition("/")
    errors = validate_object(group, version, obj["kind"], obj)
    assert errors == [], [str(e) for e in errors]


def round_trip(obj: dict[str, Any]) -> dict[str, Any]:
    before = copy.deepcopy(obj)
    beta = convert_resource(obj, "v1beta1")
    assert obj == before  # the input is never modified
    assert beta["apiVersion"] == "resource.k8s.io/v1beta1"
    assert_valid(beta)
    back = convert_resource(beta, "v1")
    assert back == obj
    return beta


def test_storage_version_is_v1() -> None:
    assert STORAGE_VERSION == "v1"


def test_slice_devices_get_wrapped_in_basic() -> None:
    v1 = h100_slice(devices=2)
    v1["spec"]["devices"][1]["taints"] = [
        {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoExecute", "timeAdded": "2026-12-03T06:00:00Z"}
    ]
    v1["spec"]["devices"][1]["consumesCounters"] = [
        {"counterSet": "gpu-1-counter-set", "counters": {"memory": {"value": "80Gi"}}}
    ]
    beta = round_trip(v1)
    device = beta["spec"]["devices"][1]
    assert set(device) == {"name", "basic"} and device["name"] == "gpu-1"
    assert device["basic"]["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert device["basic"]["capacity"] == {"memory": {"value": "80Gi"}}
    assert device["basic"]["taints"][0]["effect"] == "NoExecute"
    assert beta["spec"]["pool"] == v1["spec"]["pool"] and beta["metadata"] == v1["metadata"]


def test_v1beta1_slice_to_v1_and_back() -> None:
    beta = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceSlice",
        "metadata": {"name": "s"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "n",
            "pool": {"name": "n", "generation": 3, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "basic": {"attributes": {"type": {"string": "gpu"}}, "capacity": {"memory": {"value": "40Gi"}}},
                }
            ],
        },
    }
    v1 = convert_resource(beta, "v1")
    assert v1["spec"]["devices"] == [
        {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}, "capacity": {"memory": {"value": "40Gi"}}}
    ]
    assert_valid(v1)
    assert convert_resource(v1, "v1beta1") == beta


def test_claim_requests_flatten_and_nest_exactly() -> None:
    v1 = claim()
    v1["status"] = {
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
                ],
                "config": [
                    {
                        "source": "FromClaim",
                        "requests": ["gpu"],
                        "opaque": {"driver": "gpu.nvidia.com", "parameters": {"a": 1}},
                    }
                ],
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}
                ]
            },
        },
        "reservedFor": [{"resource": "pods", "name": "pod-a", "uid": "0b1c"}],
    }
    beta = round_trip(v1)
    gpu, mig = beta["spec"]["devices"]["requests"]
    assert gpu["deviceClassName"] == "gpu.nvidia.com" and gpu["count"] == 1 and "exactly" not in gpu
    assert gpu["selectors"] == v1["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
    assert mig == v1["spec"]["devices"]["requests"][1]  # firstAvailable has the same shape in both
    assert beta["status"] == v1["status"]


def test_v1beta1_request_with_only_a_class_gets_exactly() -> None:
    beta = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", "deviceClassName": "gpu.nvidia.com", "allocationMode": "All", "adminAccess": True}
                ]
            }
        },
    }
    v1 = convert_resource(beta, "resource.k8s.io/v1")
    assert v1["spec"]["devices"]["requests"] == [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "All", "adminAccess": True}}
    ]
    assert convert_resource(v1, "v1beta1") == beta


def test_template_and_class_round_trip() -> None:
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {"metadata": {"labels": {"app": "x"}}, "spec": claim()["spec"]},
    }
    beta = round_trip(template)
    assert beta["spec"]["spec"]["devices"]["requests"][0]["deviceClassName"] == "gpu.nvidia.com"
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "gpu.nvidia.com"},
        "spec": {
            "selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}],
            "config": [{"opaque": {"driver": "gpu.nvidia.com", "parameters": {"x": 1}}}],
        },
    }
    assert round_trip(device_class)["spec"] == device_class["spec"]


def test_lists_convert_every_item() -> None:
    items = [h100_slice(devices=1), h100_slice(devices=2)]
    listing = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSliceList",
        "metadata": {"resourceVersion": "9"},
        "items": items,
    }
    beta = convert_resource(listing, "v1beta1")
    assert beta["apiVersion"] == "resource.k8s.io/v1beta1" and beta["metadata"] == {"resourceVersion": "9"}
    assert all(item["apiVersion"] == "resource.k8s.io/v1beta1" for item in beta["items"])
    assert "basic" in beta["items"][1]["spec"]["devices"][1]
    assert convert_resource(beta, "v1") == listing


def test_reference_workloads_round_trip() -> None:
    converted = 0
    for path in sorted(glob.glob(str(WORKLOADS / "*.yaml"))):
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if doc and doc["apiVersion"].startswith("resource.k8s.io/"):
                round_trip(doc)
                converted += 1
    assert converted >= 10


def test_non_dra_objects_only_get_the_api_version() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": []}}
    assert convert_resource(pod, "v1") == pod
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}}
    assert convert_resource(deployment, "v1") == deployment
    crd_object = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain", "spec": {"numNodes": 1}}
    assert convert_resource(crd_object, "v1")["apiVersion"] == "resource.nvidia.com/v1"


def test_bad_input_says_what_is_wrong() -> None:
    with pytest.raises(ConversionError, match="not served"):
        convert_resource(h100_slice(), "v2")
    with pytest.raises(ConversionError, match="without apiVersion"):
        convert_resource({"kind": "ResourceSlice"}, "v1")
    with pytest.raises(ConversionError, match="different API groups"):
        convert_resource(h100_slice(), "apps/v1")


def test_field_paths_map_to_the_v1beta1_shape() -> None:
    assert (
        v1_field_path_to("ResourceSlice", "spec.devices[3].attributes[x]", "v1beta1")
        == "spec.devices[3].basic.attributes[x]"
    )
    assert v1_field_path_to("ResourceSlice", "spec.devices[3].name", "v1beta1") == "spec.devices[3].name"
    assert v1_field_path_to("ResourceSlice", "spec.devices[3]", "v1beta1") == "spec.devices[3]"
    assert (
        v1_field_path_to("ResourceClaim", "spec.devices.requests[0].exactly.count", "v1beta1")
        == "spec.devices.requests[0].count"
    )
    assert (
        v1_field_path_to("ResourceClaimTemplate", "spec.spec.devices.requests[1].exactly", "v1beta1")
        == "spec.spec.devices.requests[1]"
    )
    assert (
        v1_field_path_to("ResourceClaim", "spec.devices.requests[0].exactly.count", "v1")
        == "spec.devices.requests[0].exactly.count"
    )
