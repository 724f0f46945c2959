"""The objects the validation tests build on: a realistic H100 ResourceSlice (8 devices, each with the
attributes the driver publishes) and a ResourceClaim using every request form, and helpers that validate a
slice and name its errors' fields (tests/apiserver/test_validation_*.py, test_conversion.py)."""

from __future__ import annotations

from typing import Any

from embedded.apiserver.validation import FieldError, validate_object


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
