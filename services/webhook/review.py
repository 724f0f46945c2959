"""AdmissionReview v1 in, AdmissionReview v1 out: ResourceClaims and ResourceClaimTemplates checked with the
preparer's own config code (`shared.claimconfigs`, `parse_channel_config`), so a claim the preparer would
refuse is refused at `kubectl apply`, with the preparer's message behind the field path it belongs to.

Pure: `review(body, gates)` takes the decoded AdmissionReview and returns the one to send back.
Both `resource.k8s.io` shapes are read: v1 (`requests[].exactly`, `firstAvailable`) and v1beta1
(`requests[].deviceClassName`). Configs of other drivers, and requests of classes that are not ours,
are left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

from services.computedomain.channelcore import ChannelConfigError, parse_channel_config
from shared.claimconfigs import ClaimConfigError, RawConfig, check_gates, select
from shared.deviceclasses import CD_DRIVER, GPU_DEVICE_KIND, GPU_DRIVER
from shared.featuregates import FeatureGates

REVIEW_API_VERSION = "admission.k8s.io/v1"
RESOURCES = {"resourceclaims": "spec", "resourceclaimtemplates": "spec.spec"}


class ReviewError(ValueError):
    """The AdmissionReview itself is malformed (not a claim's fault): answered with a refusal saying so."""


def _at(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _requests(devices: dict[str, Any], path: str) -> Iterator[tuple[str, str, bool, str]]:
    """(request name, device class, asks for capacity, field path) for each request and subrequest."""
    for i, req in enumerate(devices.get("requests") or []):
        if not isinstance(req, dict):
            continue
        where = f"{path}.requests[{i}]"
        found = req.get("exactly")
        exactly: dict[str, Any] = found if isinstance(found, dict) else req  # v1 | v1beta1
        if exactly.get("deviceClassName"):
            yield (
                str(req.get("name", "")),
                str(exactly["deviceClassName"]),
                bool(exactly.get("capacity")),
                f"{where}{'.exactly' if exactly is not req else ''}",
            )
        for j, sub in enumerate(req.get("firstAvailable") or []):
            if isinstance(sub, dict):
                yield (
                    f"{req.get('name', '')}/{sub.get('name', '')}",
                    str(sub.get("deviceClassName", "")),
                    bool(sub.get("capacity")),
                    f"{where}.firstAvailable[{j}]",
                )


def spec_errors(devices: Any, path: str, gates: FeatureGates) -> list[str]:
    """What the preparer would refuse in a claim spec's `devices` (at `path`), each naming its field."""
    if not isinstance(devices, dict):
        return []
    errors: list[str] = []
    results: list[tuple[str, str]] = []
    for name, device_class, capacity, where in _requests(devices, path):
        kind = GPU_DEVICE_KIND.get(device_class)
        if kind is None:
            continue
        try:
            check_gates(kind, share=capacity, dynamic_mig=False, enabled=gates.enabled)
        except ClaimConfigError as exc:
            errors.append(f"{where}: {exc}")
        results.append((name, kind))
    configs = [c for c in devices.get("config") or [] if isinstance(c, dict)]
    try:  # the claim-wide limits (config entries per claim)
        select(GPU_DRIVER, [RawConfig()] * len(configs), [])
    except ClaimConfigError as exc:
        return [*errors, f"{path}.config: {exc}"]
    for i, config in enumerate(configs):
        found = config.get("opaque")
        opaque: dict[str, Any] = found if isinstance(found, dict) else {}
        driver, parameters = opaque.get("driver"), opaque.get("parameters")
        where = f"{path}.config[{i}].opaque.parameters"
        try:
            if driver == GPU_DRIVER:
                raw = RawConfig(requests=list(config.get("requests") or []), driver=GPU_DRIVER, parameters=parameters)
                select(GPU_DRIVER, [raw], results)
            elif driver == CD_DRIVER:
                parse_channel_config(parameters if isinstance(parameters, dict) else msgspec.json.encode(parameters))
        except (ClaimConfigError, ChannelConfigError) as exc:
            errors.append(f"{where}: {exc}")
    return errors


def object_errors(resource: str, obj: Any, gates: FeatureGates) -> list[str]:
    """`spec_errors` of a ResourceClaim or ResourceClaimTemplate object."""
    path = RESOURCES[resource]
    return spec_errors(_at(obj, f"{path}.devices"), f"{path}.devices", gates)


def review(body: Any, gates: FeatureGates) -> dict[str, Any]:
    """The AdmissionReview response for request `body`; ReviewError for a body that is no AdmissionReview."""
    if (
        not isinstance(body, dict)
        or body.get("apiVersion") != REVIEW_API_VERSION
        or body.get("kind") != "AdmissionReview"
        or not isinstance(body.get("request"), dict)
    ):
        raise ReviewError(f"expected an {REVIEW_API_VERSION} AdmissionReview with a request")
    request = body["request"]
    uid = str(request.get("uid", ""))
    resource = request.get("resource") or {}
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if resource.get("group") != "resource.k8s.io" or resource.get("resource") not in RESOURCES:
        response.update(
            allowed=False,
            status={
                "code": 400,
                "reason": "BadRequest",
                "message": "expected a resource.k8s.io resourceclaims or "
                f"resourceclaimtemplates request, got {resource.get('group')}/{resource.get('resource')}",
            },
        )
    elif request.get("operation") in ("CREATE", "UPDATE"):
        errors = object_errors(resource["resource"], request.get("object"), gates)
        if errors:
            message = errors[0] if len(errors) == 1 else f"{len(errors)} problems: " + "; ".join(errors)
            response.update(allowed=False, status={"reason": "Invalid", "message": message})  # 400, as NVIDIA's
    return {"apiVersion": REVIEW_API_VERSION, "kind": "AdmissionReview", "response": response}
