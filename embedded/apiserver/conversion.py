"""Conversion between the served versions of resource.k8s.io (v1 and v1beta1; v1beta2 has the v1
shape) for DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice and their Lists.
Objects are stored in STORAGE_VERSION and converted on the way in and out.

The two shapes differ in two places: a v1beta1 Device wraps everything but `name` in `basic`, and
a v1beta1 DeviceRequest carries the exact-request fields flat where v1 nests them in `exactly`.
Every other field has the same name and meaning, so a round trip keeps every field both versions
have. Inputs are never modified."""

from __future__ import annotations

import copy
import re
from typing import Any

GROUP = "resource.k8s.io"
STORAGE_VERSION = "v1"
SERVED_VERSIONS = ("v1", "v1beta2", "v1beta1")
DRA_KINDS = frozenset({"DeviceClass", "ResourceClaim", "ResourceClaimTemplate", "ResourceSlice"})

_V1_SHAPE = frozenset({"v1", "v1beta2"})
_KNOWN = _V1_SHAPE | {"v1beta1"}
# Fields of a v1 ExactDeviceRequest, which v1beta1 puts directly on the DeviceRequest.
EXACT_FIELDS = (
    "deviceClassName",
    "selectors",
    "allocationMode",
    "count",
    "adminAccess",
    "tolerations",
    "capacity",
    "derivedAttributes",
)


class ConversionError(ValueError):
    """The object or the target version cannot be converted; the message says which and why."""


def split_api_version(api_version: str) -> tuple[str, str]:
    """`resource.k8s.io/v1` -> ("resource.k8s.io", "v1"); `v1` -> ("", "v1")."""
    group, _, version = api_version.rpartition("/")
    return group, version


def convert_resource(obj: dict[str, Any], to_version: str) -> dict[str, Any]:
    """A converted deep copy of `obj` in `to_version` (a version such as "v1beta1", or a full
    apiVersion such as "resource.k8s.io/v1beta1"). Non-DRA objects only get apiVersion set."""
    if not isinstance(obj, dict):
        raise ConversionError(f"cannot convert a {type(obj).__name__}: expected a JSON object")
    api_version = obj.get("apiVersion")
    if not isinstance(api_version, str) or not api_version:
        raise ConversionError("cannot convert an object without apiVersion: set apiVersion, e.g. resource.k8s.io/v1")
    group, from_version = split_api_version(api_version)
    target_group, target = split_api_version(to_version)
    if target_group and target_group != group:
        raise ConversionError(f"cannot convert {api_version} to {to_version}: different API groups")
    kind = obj.get("kind", "")
    base_kind = kind[:-4] if isinstance(kind, str) and kind.endswith("List") else kind
    out = copy.deepcopy(obj)
    out["apiVersion"] = f"{group}/{target}" if group else target
    if group != GROUP or base_kind not in DRA_KINDS:
        return out
    for version in (from_version, target):
        if version not in _KNOWN:
            raise ConversionError(
                f"resource.k8s.io version {version!r} is not served: use one of {', '.join(sorted(_KNOWN))}"
            )
    if kind != base_kind:
        items = out.get("items")
        if isinstance(items, list):
            out["items"] = [_convert_body(base_kind, item, from_version, target, group) for item in items]
        return out
    converted: dict[str, Any] = _convert_body(base_kind, out, from_version, target, group, copied=True)
    return converted


def _convert_body(kind: str, obj: Any, source: str, target: str, group: str, copied: bool = False) -> Any:
    if not isinstance(obj, dict):
        return obj
    if not copied:
        obj = dict(obj)
    obj["apiVersion"] = f"{group}/{target}"
    obj.setdefault("kind", kind)
    if (source in _V1_SHAPE) == (target in _V1_SHAPE):
        return obj
    to_v1 = target in _V1_SHAPE
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return obj
    if kind == "ResourceSlice":
        devices = spec.get("devices")
        if isinstance(devices, list):
            spec["devices"] = [_device_to_v1(d) if to_v1 else _device_to_v1beta1(d) for d in devices]
    elif kind == "ResourceClaim":
        _claim_spec(spec, to_v1)
    elif kind == "ResourceClaimTemplate":
        inner = spec.get("spec")
        if isinstance(inner, dict):
            _claim_spec(inner, to_v1)
    return obj


def _device_to_v1(device: Any) -> Any:
    if not isinstance(device, dict) or "basic" not in device:
        return device
    out = {k: v for k, v in device.items() if k != "basic"}
    basic = device.get("basic")
    if isinstance(basic, dict):
        for key, value in basic.items():
            out.setdefault(key, value)
    return out


def _device_to_v1beta1(device: Any) -> Any:
    if not isinstance(device, dict):
        return device
    out: dict[str, Any] = {}
    basic: dict[str, Any] = {}
    for key, value in device.items():
        if key == "name":
            out[key] = value
        else:
            basic[key] = value
    out["basic"] = basic
    return out


def _claim_spec(spec: dict[str, Any], to_v1: bool) -> None:
    devices = spec.get("devices")
    if not isinstance(devices, dict):
        return
    requests = devices.get("requests")
    if isinstance(requests, list):
        devices["requests"] = [_request_to_v1(r) if to_v1 else _request_to_v1beta1(r) for r in requests]


def _request_to_v1(request: Any) -> Any:
    if not isinstance(request, dict):
        return request
    out: dict[str, Any] = {}
    exactly: dict[str, Any] = {}
    for key, value in request.items():
        if key in EXACT_FIELDS:
            exactly[key] = value
        else:
            out[key] = value
    if exactly or not request.get("firstAvailable"):
        out["exactly"] = exactly
    return out


def _request_to_v1beta1(request: Any) -> Any:
    if not isinstance(request, dict):
        return request
    out: dict[str, Any] = {}
    for key, value in request.items():
        if key == "exactly":
            if isinstance(value, dict):
                for inner_key, inner_value in value.items():
                    out[inner_key] = inner_value
        else:
            out[key] = value
    return out


_SLICE_DEVICE = re.compile(r"^(spec\.devices\[\d+\])\.(?!name(?:$|[.\[]))", re.ASCII)
_CLAIM_EXACT = {
    "ResourceClaim": re.compile(r"^(spec\.devices\.requests\[\d+\])\.exactly(?=$|[.\[])"),
    "ResourceClaimTemplate": re.compile(r"^(spec\.spec\.devices\.requests\[\d+\])\.exactly(?=$|[.\[])"),
}


def v1_field_path_to(kind: str, path: str, version: str) -> str:
    """Rewrites a field path of the v1 shape into the path the same field has in `version`.
    validation.py does not use it: the real server reports DRA-rule errors with the paths of its
    internal (v1-shaped) object whatever version was sent, and so do we. Kept for callers that
    want client-shaped paths (e.g. for warnings)."""
    if version in _V1_SHAPE:
        return path
    if kind == "ResourceSlice":
        return _SLICE_DEVICE.sub(r"\1.basic.", path, count=1)
    rx = _CLAIM_EXACT.get(kind)
    return rx.sub(r"\1", path, count=1) if rx is not None else path
