"""The resource.k8s.io rules for ResourceClaims, ResourceClaimTemplates and DeviceClasses beyond
the OpenAPI schema: request unions (exactly / firstAvailable), selectors (CEL syntax, length and
estimated cost, as `validateSelector`: "too complex, exceeds cost limit"), constraints,
opaque config size, tolerations, and the claim status (allocation, reservedFor, device status).
Objects are in the v1 shape; messages and paths follow the real server's.

Over ~400 lines on purpose: the spec and status rules share the request-name and opaque-config
helpers, and splitting them would scatter one upstream validation file over three modules."""

from __future__ import annotations

import functools
import ipaddress
import json
import re
from typing import Any

from embedded.apiserver import _schemas_errors as fe
from embedded.apiserver import _schemas_names as names
from embedded.apiserver._schemas_dra import (
    MAX_CEL_LEN,
    MAX_CONFIGS,
    MAX_CONSTRAINTS,
    MAX_DEVICE_CONDITIONS,
    MAX_DEVICE_STATUS_DATA,
    MAX_HARDWARE_ADDRESS,
    MAX_INTERFACE_NAME,
    MAX_IPS,
    MAX_OPAQUE_PARAMETERS,
    MAX_REQUESTS,
    MAX_RESERVED_FOR,
    MAX_RESULTS,
    MAX_SELECTORS,
    MAX_SUBREQUESTS,
    MAX_TOLERATIONS,
    Errors,
    as_list,
    as_map,
    check_pool_name,
    driver_name_errors,
    name_errors,
    qualified_name_errors,
)
from embedded.scheduler import celcost
from embedded.scheduler.celparse import CelSyntaxError

_TOLERATION_EFFECTS = ["NoSchedule", "NoExecute", "None"]
_ALLOCATION_MODES = ["All", "ExactCount"]
_OPERATORS = ["Equal", "Exists"]
_CONFIG_SOURCES = ["FromClaim", "FromClass"]
_REF_MSG = "must be the name of a request in the claim or the name of a request and a subrequest separated by '/'"
_UID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")

RequestNames = dict[str, set[str]]  # request -> its subrequest names (empty for an exact request)


def request_names(spec: dict[str, Any]) -> RequestNames:
    """The requests of a claim spec (v1 shape) and their subrequests, for "req" / "req/sub" refs."""
    found: RequestNames = {}
    for request in as_list(as_map(spec.get("devices")).get("requests")):
        request = as_map(request)
        name = request.get("name")
        if isinstance(name, str):
            found[name] = {
                str(s["name"])
                for s in as_list(request.get("firstAvailable"))
                if isinstance(s, dict) and isinstance(s.get("name"), str)
            }
    return found


def _has_request(known: RequestNames, ref: str) -> bool:
    segments = ref.split("/")
    if len(segments) > 2 or segments[0] not in known:
        return False
    return len(segments) == 1 or segments[1] in known[segments[0]]


def validate_claim_spec(spec: dict[str, Any], errors: Errors, path: str = "spec") -> None:
    devices = as_map(spec.get("devices"))
    dpath = f"{path}.devices"
    known = request_names(spec)
    requests = as_list(devices.get("requests"))
    if len(requests) > MAX_REQUESTS:
        errors.append(fe.too_many(f"{dpath}.requests", len(requests), MAX_REQUESTS))
    else:
        seen: set[str] = set()
        for i, request in enumerate(requests):
            request = as_map(request)
            rpath = f"{dpath}.requests[{i}]"
            _request(rpath, request, errors)
            name = request.get("name")
            if isinstance(name, str):
                if name in seen:
                    errors.append(fe.duplicate(rpath, name))
                seen.add(name)
    constraints = as_list(devices.get("constraints"))
    if len(constraints) > MAX_CONSTRAINTS:
        errors.append(fe.too_many(f"{dpath}.constraints", len(constraints), MAX_CONSTRAINTS))
    else:
        for i, constraint in enumerate(constraints):
            _constraint(f"{dpath}.constraints[{i}]", as_map(constraint), known, errors)
    configs = as_list(devices.get("config"))
    if len(configs) > MAX_CONFIGS:
        errors.append(fe.too_many(f"{dpath}.config", len(configs), MAX_CONFIGS))
    else:
        for i, config in enumerate(configs):
            config = as_map(config)
            cpath = f"{dpath}.config[{i}]"
            _request_refs(f"{cpath}.requests", config.get("requests"), known, errors)
            _device_config(cpath, config, errors)


def _request(path: str, request: dict[str, Any], errors: Errors) -> None:
    name_errors(f"{path}.name", request.get("name"), names.dns1123_label, errors)
    exactly = request.get("exactly")
    first = as_list(request.get("firstAvailable"))
    if exactly is None and not first:
        errors.append(fe.required(path, "exactly one of `exactly` or `firstAvailable` is required"))
    elif exactly is not None and first:
        errors.append(
            fe.invalid(
                path, None, "exactly one of `exactly` or `firstAvailable` is required, but multiple fields are set"
            )
        )
    elif first:
        if len(first) > MAX_SUBREQUESTS:
            errors.append(fe.too_many(f"{path}.firstAvailable", len(first), MAX_SUBREQUESTS))
            return
        seen: set[str] = set()
        for j, sub in enumerate(first):
            sub = as_map(sub)
            spath = f"{path}.firstAvailable[{j}]"
            name_errors(f"{spath}.name", sub.get("name"), names.dns1123_label, errors)
            _exact(spath, sub, errors)
            sub_name = sub.get("name")
            if isinstance(sub_name, str):
                if sub_name in seen:
                    errors.append(fe.duplicate(spath, sub_name))
                seen.add(sub_name)
    else:
        _exact(f"{path}.exactly", as_map(exactly), errors)


def _exact(path: str, request: dict[str, Any], errors: Errors) -> None:
    name_errors(f"{path}.deviceClassName", request.get("deviceClassName"), names.dns1123_subdomain, errors)
    _selectors(f"{path}.selectors", request.get("selectors"), errors)
    # allocationMode and count are defaulted (ExactCount, 1) before validation on a real server
    mode = request.get("allocationMode") or "ExactCount"
    count = request.get("count")
    if mode == "All":
        if count not in (None, 0):
            errors.append(fe.invalid(f"{path}.count", count, "must not be specified when allocationMode is 'All'"))
    elif mode == "ExactCount":
        if isinstance(count, int) and count <= 0:
            errors.append(fe.invalid(f"{path}.count", count, "must be greater than zero"))
    else:
        errors.append(fe.not_supported(f"{path}.allocationMode", mode, _ALLOCATION_MODES))
    tolerations = as_list(request.get("tolerations"))
    if len(tolerations) > MAX_TOLERATIONS:
        errors.append(fe.too_many(f"{path}.tolerations", len(tolerations), MAX_TOLERATIONS))
    else:
        for i, toleration in enumerate(tolerations):
            _toleration(f"{path}.tolerations[{i}]", as_map(toleration), errors)
    requests = as_map(as_map(request.get("capacity")).get("requests"))
    for key in requests:
        qualified_name_errors(f"{path}.capacity.requests[{key}]", key, errors)


def _selectors(path: str, selectors: Any, errors: Errors) -> None:
    selectors = as_list(selectors)
    if len(selectors) > MAX_SELECTORS:
        errors.append(fe.too_many(path, len(selectors), MAX_SELECTORS))
        return
    for i, selector in enumerate(selectors):
        cel = as_map(selector).get("cel")
        spath = f"{path}[{i}]"
        if not isinstance(cel, dict):
            errors.append(fe.required(f"{spath}.cel"))
            continue
        expression = cel.get("expression")
        epath = f"{spath}.cel.expression"
        if not isinstance(expression, str) or not expression.strip():
            errors.append(fe.required(epath, "expression must not be empty"))
        elif len(expression) > MAX_CEL_LEN:
            errors.append(fe.too_long(epath, MAX_CEL_LEN))
        else:
            problem, too_complex = cel_syntax_error(expression), False
            try:  # upstream's worst-case cost check (CELSelectorExpressionMaxCost), after the syntax
                too_complex = not problem and celcost.estimate(expression).exceeds
            except CelSyntaxError as exc:  # text the `cel` package takes but the estimator's parser does not
                problem = f"ERROR: <input>: {exc}"
            if problem:
                errors.append(fe.invalid(epath, expression, f"compilation failed: {problem}"))
            elif too_complex:
                errors.append(fe.forbidden(epath, "too complex, exceeds cost limit"))


@functools.lru_cache(maxsize=1024)
def cel_syntax_error(expression: str) -> str:
    """The parser's message for a CEL expression that does not parse, "" when it does. Only syntax
    is checked here (the real server also type-checks against the DRA environment)."""
    try:
        import cel  # common-expression-language
    except ImportError:
        return ""
    try:
        cel.compile(expression)
    except ValueError as exc:
        text = str(exc)
        marker = text.find("ERROR:")
        return text[marker:] if marker >= 0 else text
    return ""


def _toleration(path: str, toleration: dict[str, Any], errors: Errors) -> None:
    key = toleration.get("key")
    if key:
        for detail in names.qualified_name(key):
            errors.append(fe.invalid(f"{path}.key", key, detail))
    operator = toleration.get("operator") or "Equal"
    if operator not in _OPERATORS:
        errors.append(fe.not_supported(f"{path}.operator", operator, _OPERATORS))
    elif operator == "Exists" and toleration.get("value"):
        errors.append(
            fe.invalid(f"{path}.operator", toleration.get("value"), "value must be empty when `operator` is 'Exists'")
        )
    elif operator == "Equal" and not key:
        errors.append(fe.invalid(f"{path}.operator", operator, "operator must be Exists when `key` is empty"))
    effect = toleration.get("effect")
    if effect and effect not in _TOLERATION_EFFECTS:
        errors.append(fe.not_supported(f"{path}.effect", effect, _TOLERATION_EFFECTS))


def _constraint(path: str, constraint: dict[str, Any], known: RequestNames, errors: Errors) -> None:
    _request_refs(f"{path}.requests", constraint.get("requests"), known, errors)
    chosen = [f for f in ("matchAttribute", "distinctAttribute") if constraint.get(f) is not None]
    if not chosen:
        errors.append(
            fe.required(
                path, 'exactly one of "matchAttribute" or "distinctAttribute" is required, but multiple fields are set'
            )
        )
    elif len(chosen) > 1:
        errors.append(
            fe.invalid(
                path,
                None,
                'exactly one of "matchAttribute" or "distinctAttribute" is required, but multiple fields are set',
            )
        )
    for field in chosen:
        value = constraint[field]
        if not isinstance(value, str):
            continue
        fpath = f"{path}.{field}"
        qualified_name_errors(fpath, value, errors)
        if "/" not in value:
            errors.append(
                fe.invalid(fpath, value, "a fully qualified name must be a domain and a name separated by a slash")
            )


def _request_refs(path: str, refs: Any, known: RequestNames, errors: Errors) -> None:
    refs = as_list(refs)
    if len(refs) > MAX_REQUESTS:
        errors.append(fe.too_many(path, len(refs), MAX_REQUESTS))
        return
    seen: set[str] = set()
    for i, ref in enumerate(refs):
        if not isinstance(ref, str):
            continue
        rpath = f"{path}[{i}]"
        _request_ref(rpath, ref, known, errors)
        if ref in seen:
            errors.append(fe.duplicate(rpath, ref))
        seen.add(ref)


def _request_ref(path: str, ref: str, known: RequestNames, errors: Errors) -> None:
    """ "req" or "req/sub", naming a request (and subrequest) of the claim."""
    segments = ref.split("/")
    if len(segments) > 2:
        errors.append(fe.invalid(path, ref, _REF_MSG))
        return
    for segment in segments:
        name_errors(path, segment, names.dns1123_label, errors)
    if not _has_request(known, ref):
        errors.append(fe.invalid(path, ref, _REF_MSG))


def _device_config(path: str, config: dict[str, Any], errors: Errors) -> None:
    opaque = config.get("opaque")
    if not isinstance(opaque, dict):
        errors.append(fe.required(f"{path}.opaque"))
        return
    opath = f"{path}.opaque"
    driver_name_errors(f"{opath}.driver", opaque.get("driver"), errors)
    _raw_extension(f"{opath}.parameters", opaque.get("parameters"), MAX_OPAQUE_PARAMETERS, errors)


def _raw_extension(path: str, value: Any, limit: int, errors: Errors) -> None:
    if value is None:
        errors.append(fe.required(path))
        return
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > limit:
        errors.append(fe.too_long(path, limit))
    elif not isinstance(value, dict):
        errors.append(fe.invalid(path, "<value omitted>", "must be a valid JSON object"))


def validate_class_spec(spec: dict[str, Any], errors: Errors, path: str = "spec") -> None:
    _selectors(f"{path}.selectors", spec.get("selectors"), errors)
    configs = as_list(spec.get("config"))
    if len(configs) > MAX_CONFIGS:
        errors.append(fe.too_many(f"{path}.config", len(configs), MAX_CONFIGS))
    else:
        for i, config in enumerate(configs):
            _device_config(f"{path}.config[{i}]", as_map(config), errors)
    extended = spec.get("extendedResourceName")
    if isinstance(extended, str) and not _is_extended_resource_name(extended):
        errors.append(fe.invalid(f"{path}.extendedResourceName", extended, "must be a valid extended resource name"))


def _is_extended_resource_name(name: str) -> bool:
    """Like v1helper.IsExtendedResourceName: a domain-qualified name outside kubernetes.io."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    return not names.qualified_name("requests." + name)


# -- status -------------------------------------------------------------------------------------


def validate_claim_status(
    status: dict[str, Any],
    errors: Errors,
    path: str = "status",
    known: RequestNames | None = None,
    old_status: dict[str, Any] | None = None,
) -> None:
    """reservedFor, device status and the allocation. A populated allocation may only be cleared:
    with `old_status` holding one, a changed allocation is immutable and is not re-validated."""
    allocation = status.get("allocation")
    reserved = as_list(status.get("reservedFor"))
    if len(reserved) > MAX_RESERVED_FOR:
        errors.append(fe.too_many(f"{path}.reservedFor", len(reserved), MAX_RESERVED_FOR))
    else:
        uids: set[str] = set()
        for i, ref in enumerate(reserved):
            uid = as_map(ref).get("uid")
            if isinstance(uid, str):
                if uid in uids:
                    errors.append(fe.duplicate(f"{path}.reservedFor[{i}]", uid))
                uids.add(uid)
    allocated = {_device_id(r) for r in as_list(as_map(as_map(allocation).get("devices")).get("results"))}
    seen: set[str] = set()
    for i, device in enumerate(as_list(status.get("devices"))):
        device = as_map(device)
        dpath = f"{path}.devices[{i}]"
        _device_status(dpath, device, allocated, errors)
        ident = _device_id(device)
        if ident in seen:
            errors.append(fe.duplicate(dpath, ident))
        seen.add(ident)
    if reserved and allocation is None:
        errors.append(fe.forbidden(f"{path}.reservedFor", "may not be specified when `allocated` is not set"))
    old_allocation = (old_status or {}).get("allocation")
    if old_allocation is not None and allocation is not None:
        if allocation != old_allocation:
            errors.append(fe.invalid(f"{path}.allocation", allocation, "field is immutable"))
    elif isinstance(allocation, dict):
        _allocation(f"{path}.allocation", allocation, known or {}, errors)


def _device_id(device: Any) -> str:
    device = as_map(device)
    ident = f"{device.get('driver')}/{device.get('pool')}/{device.get('device')}"
    share = device.get("shareID")
    return f"{ident}/{share}" if share else ident


def _allocation(path: str, allocation: dict[str, Any], known: RequestNames, errors: Errors) -> None:
    devices = as_map(allocation.get("devices"))
    results = as_list(devices.get("results"))
    if len(results) > MAX_RESULTS:
        errors.append(fe.too_many(f"{path}.devices.results", len(results), MAX_RESULTS))
    else:
        for i, result in enumerate(results):
            result = as_map(result)
            rpath = f"{path}.devices.results[{i}]"
            request = result.get("request")
            if isinstance(request, str):
                _request_ref(f"{rpath}.request", request, known, errors)
            driver_name_errors(f"{rpath}.driver", result.get("driver"), errors)
            check_pool_name(f"{rpath}.pool", result.get("pool"), errors)
            name_errors(f"{rpath}.device", result.get("device"), names.dns1123_label, errors)
            _share_id(f"{rpath}.shareID", result.get("shareID"), errors)
            for key in as_map(result.get("consumedCapacity")):
                qualified_name_errors(f"{rpath}.consumedCapacity[{key}]", key, errors)
    configs = as_list(devices.get("config"))
    if len(configs) > 2 * MAX_CONFIGS:
        errors.append(fe.too_many(f"{path}.devices.config", len(configs), 2 * MAX_CONFIGS))
        return
    for i, config in enumerate(configs):
        config = as_map(config)
        cpath = f"{path}.devices.config[{i}]"
        source = config.get("source")
        if not source:
            errors.append(fe.required(f"{cpath}.source"))
        elif source not in _CONFIG_SOURCES:
            errors.append(fe.not_supported(f"{cpath}.source", source, _CONFIG_SOURCES))
        _request_refs(f"{cpath}.requests", config.get("requests"), known, errors)
        _device_config(cpath, config, errors)


def _share_id(path: str, value: Any, errors: Errors) -> None:
    if isinstance(value, str) and not _UID_RE.match(value):
        errors.append(
            fe.invalid(
                path,
                value,
                "uid must be in RFC 4122 normalized form, "
                "`xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with lowercase hexadecimal characters",
            )
        )


def _device_status(path: str, device: dict[str, Any], allocated: set[str], errors: Errors) -> None:
    driver_name_errors(f"{path}.driver", device.get("driver"), errors)
    check_pool_name(f"{path}.pool", device.get("pool"), errors)
    name_errors(f"{path}.device", device.get("device"), names.dns1123_label, errors)
    _share_id(f"{path}.shareID", device.get("shareID"), errors)
    ident = _device_id(device)
    if ident not in allocated:
        errors.append(fe.invalid(path, ident, "must be an allocated device in the claim"))
    conditions = as_list(device.get("conditions"))
    if len(conditions) > MAX_DEVICE_CONDITIONS:
        errors.append(fe.too_many(f"{path}.conditions", len(conditions), MAX_DEVICE_CONDITIONS))
    if device.get("data") is not None:
        _raw_extension(f"{path}.data", device["data"], MAX_DEVICE_STATUS_DATA, errors)
    network = as_map(device.get("networkData"))
    interface = network.get("interfaceName")
    if isinstance(interface, str) and len(interface) > MAX_INTERFACE_NAME:
        errors.append(fe.too_long(f"{path}.networkData.interfaceName", MAX_INTERFACE_NAME))
    hardware = network.get("hardwareAddress")
    if isinstance(hardware, str) and len(hardware) > MAX_HARDWARE_ADDRESS:
        errors.append(fe.too_long(f"{path}.networkData.hardwareAddress", MAX_HARDWARE_ADDRESS))
    ips = as_list(network.get("ips"))
    if len(ips) > MAX_IPS:
        errors.append(fe.too_many(f"{path}.networkData.ips", len(ips), MAX_IPS))
        return
    seen: set[str] = set()
    for j, cidr in enumerate(ips):
        if not isinstance(cidr, str):
            continue
        ipath = f"{path}.networkData.ips[{j}]"
        if not _is_cidr(cidr):
            errors.append(
                fe.invalid(ipath, cidr, "must be a valid address in CIDR form, (e.g. 10.9.8.7/24 or 2001:db8::1/64)")
            )
        if cidr in seen:
            errors.append(fe.duplicate(ipath, cidr))
        seen.add(cidr)


def _is_cidr(value: str) -> bool:
    try:
        ipaddress.ip_interface(value)
    except ValueError:
        return False
    return "/" in value
