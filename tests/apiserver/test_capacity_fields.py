"""Consumable capacity fields (KEP-5075) through the API server: allowMultipleAllocations and
requestPolicy on slices, capacity.requests on claims, shareID and consumedCapacity in allocations;
stored and read back in v1 and v1beta2, refused with 422 when malformed."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from embedded.apiserver.testing import RunningApiServer
from shared.kube.resources import RESOURCECLAIMS, RESOURCESLICES, Kube
from shared.kube.rest import ApiError

SHARE = "123e4567-e89b-12d3-a456-426614174000"
POLICY = {"default": "1Gi", "validRange": {"min": "1Gi", "max": "40Gi", "step": "1Gi"}}


def shareable_slice(version: str = "v1", policy: dict[str, Any] | None = None) -> dict[str, Any]:
    memory: dict[str, Any] = {"value": "80Gi", "requestPolicy": copy.deepcopy(policy or POLICY)}
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceSlice",
        "metadata": {"name": "shared"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "allowMultipleAllocations": True,
                    "capacity": {
                        "memory": memory,
                        "cores": {
                            "value": "132",
                            "requestPolicy": {"default": "33", "validValues": ["33", "66", "132"]},
                        },
                    },
                }
            ],
        },
    }


def share_claim(version: str = "v1") -> dict[str, Any]:
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"name": "tenant"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.nvidia.com",
                            "capacity": {"requests": {"memory": "1500Mi"}},
                        },
                    }
                ]
            }
        },
    }


def allocation(share: str = SHARE, consumed: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": "gpu.nvidia.com",
                        "pool": "node-a",
                        "device": "gpu-0",
                        "shareID": share,
                        "consumedCapacity": consumed or {"memory": "2Gi", "cores": "33"},
                    }
                ]
            }
        }
    }


def at(version: str) -> tuple[Any, Any]:
    return (dataclasses.replace(RESOURCESLICES, version=version), dataclasses.replace(RESOURCECLAIMS, version=version))


@pytest.mark.parametrize("version", ["v1", "v1beta2"])
async def test_capacity_fields_round_trip(api: RunningApiServer, version: str) -> None:
    slices, claims = at(version)
    async with api.client() as c:
        kube = Kube(c)
        await kube.create(slices, None, shareable_slice(version))
        got = await kube.get(slices, None, "shared")
        device = got["spec"]["devices"][0]
        assert device["allowMultipleAllocations"] is True
        assert device["capacity"]["memory"]["requestPolicy"] == POLICY
        assert device["capacity"]["cores"]["requestPolicy"]["validValues"] == ["33", "66", "132"]

        created = await kube.create(claims, "default", share_claim(version))
        assert created["spec"]["devices"]["requests"][0]["exactly"]["capacity"] == {"requests": {"memory": "1500Mi"}}
        created["status"] = allocation()
        await kube.replace(claims, created, subresource="status")
        got = await kube.get(claims, "default", "tenant")
        result = got["status"]["allocation"]["devices"]["results"][0]
        assert result["shareID"] == SHARE and result["consumedCapacity"] == {"memory": "2Gi", "cores": "33"}
        # The other version reads the same stored object.
        other = "v1beta2" if version == "v1" else "v1"
        again = await kube.get(at(other)[1], "default", "tenant")
        assert again["status"]["allocation"]["devices"]["results"][0]["shareID"] == SHARE


@pytest.mark.parametrize(
    ("policy", "field", "message"),
    [
        (
            {"default": "1Gi", "validRange": {"min": "1Gi", "max": "100Gi"}},
            "requestPolicy.validRange.max",
            "max is larger than capacity value: 80Gi",
        ),
        (
            {"default": "3Gi", "validRange": {"min": "2Gi", "step": "2Gi"}},
            "requestPolicy.validRange.step",
            "value is not a multiple of a given step (2Gi) from (2Gi)",
        ),
        (
            {"default": "500Mi", "validRange": {"min": "1Gi"}},
            "requestPolicy.validRange.min",
            "default is less than min: 1Gi",
        ),
        ({"validRange": {"min": "1Gi"}}, "requestPolicy.default", "required when validRange is defined"),
        (
            {"default": "5Gi", "validValues": ["10Gi", "20Gi"]},
            "requestPolicy.validValues",
            "default value is not valid according to the requestPolicy",
        ),
        (
            {"default": "10Gi", "validValues": ["20Gi", "10Gi"]},
            "requestPolicy.validValues[1]",
            "values must be sorted in ascending order",
        ),
        (
            {"default": "1Gi", "validRange": {"min": "1Gi"}, "validValues": ["1Gi"]},
            "requestPolicy",
            'exactly one policy can be specified, cannot specify "validValues" and "validRange" at the same time',
        ),
        ({"default": "1Gi", "validRange": {"min": "one"}}, "requestPolicy.validRange.min", "quantities must match"),
    ],
)
async def test_bad_request_policy_is_422(
    api: RunningApiServer, policy: dict[str, Any], field: str, message: str
) -> None:
    async with api.client() as c:
        with pytest.raises(ApiError) as err:
            await Kube(c).create(RESOURCESLICES, None, shareable_slice(policy=policy))
        assert err.value.status == 422
        assert f"spec.devices[0].capacity[memory].{field}: " in err.value.message and message in err.value.message


async def test_request_policy_needs_multiple_allocations(api: RunningApiServer) -> None:
    body = shareable_slice()
    del body["spec"]["devices"][0]["allowMultipleAllocations"]
    async with api.client() as c:
        with pytest.raises(ApiError) as err:
            await Kube(c).create(RESOURCESLICES, None, body)
        assert err.value.status == 422 and "allowMultipleAllocations must be true" in err.value.message


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (
            lambda s: s["allocation"]["devices"]["results"][0].update(shareID="Not-A-UID"),
            "status.allocation.devices.results[0].shareID",
        ),
        (
            lambda s: s["allocation"]["devices"]["results"][0].update(consumedCapacity={"memory": "lots"}),
            "status.allocation.devices.results[0].consumedCapacity[memory]",
        ),
        (
            lambda s: s["allocation"]["devices"]["results"][0].update(consumedCapacity={"no such": "1"}),
            "status.allocation.devices.results[0].consumedCapacity[no such]",
        ),
    ],
)
async def test_bad_share_results_are_422(api: RunningApiServer, mutate: Any, field: str) -> None:
    async with api.client() as c:
        kube = Kube(c)
        created = await kube.create(RESOURCECLAIMS, "default", share_claim())
        status = allocation()
        mutate(status)
        created["status"] = status
        with pytest.raises(ApiError) as err:
            await kube.replace(RESOURCECLAIMS, created, subresource="status")
        assert err.value.status == 422 and f"{field}: " in err.value.message


async def test_bad_capacity_request_is_422(api: RunningApiServer) -> None:
    body = share_claim()
    body["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"] = {"memory": "1.5 Gi"}
    async with api.client() as c:
        with pytest.raises(ApiError) as err:
            await Kube(c).create(RESOURCECLAIMS, "default", body)
        assert err.value.status == 422
        assert "spec.devices.requests[0].exactly.capacity.requests[memory]: " in err.value.message
