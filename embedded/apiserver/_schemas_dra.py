"""The resource.k8s.io rules the real API server enforces beyond the OpenAPI schema, for
ResourceSlices (limits, name formats, node-selection union, counters), plus the limits table and
the small helpers the claim rules (_schemas_dra_claims.py) share. Objects are in the v1 shape
(the server's internal one): callers convert v1beta1 objects first, and error paths name the v1
fields, as the real server's do. Limits and messages follow 1.35+; list limits short-circuit
(only the TooMany error, the items are not checked), as upstream does against DoS."""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any

from embedded.apiserver import _schemas_errors as fe
from embedded.apiserver import _schemas_names as names
from shared.quantity import QuantityError, parse_quantity

MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUE_LEN = 64
MAX_ID_LEN = 32
MAX_DOMAIN_LEN = 63
MAX_TAINTS = 16
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMES_COUNTERS = 2
MAX_COUNTERS_PER_CONSUMPTION = 32
MAX_BINDING_CONDITIONS = 4
MAX_REQUESTS = 32
MAX_SUBREQUESTS = 8
MAX_SELECTORS = 32
MAX_CONSTRAINTS = 32
MAX_CONFIGS = 32
MAX_TOLERATIONS = 16
MAX_CEL_LEN = 10 * 1024
MAX_OPAQUE_PARAMETERS = 10 * 1024
MAX_RESERVED_FOR = 256
MAX_RESULTS = 32
POOL_NAME_MAX = 253
MAX_DEVICE_CONDITIONS = 8
MAX_DEVICE_STATUS_DATA = 10 * 1024
MAX_INTERFACE_NAME = 256
MAX_IPS = 16
MAX_HARDWARE_ADDRESS = 128

_TAINT_EFFECTS = ["NoSchedule", "NoExecute", "None"]
_VALUE_KINDS = frozenset({"int", "bool", "string", "version", "ints", "bools", "strings", "versions"})
_PER_DEVICE_MSG = (
    "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when "
    "`perDeviceNodeSelection` is set to true in the ResourceSlice spec"
)
_NODE_UNION_MSG = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required"

Errors = list[fe.FieldError]


def name_errors(path: str, value: Any, checker: Any, errors: Errors, what: str = "") -> None:
    """Required when empty, else one Invalid per broken rule of `checker`."""
    if not isinstance(value, str) or value == "":
        errors.append(fe.required(path, what))
        return
    for detail in checker(value):
        errors.append(fe.invalid(path, value, detail))


def driver_name_errors(path: str, value: Any, errors: Errors) -> None:
    """A DRA driver name, validated like a CSI driver name."""
    if not isinstance(value, str) or value == "":
        errors.append(fe.required(path))
        return
    if len(value) > MAX_DOMAIN_LEN:
        errors.append(fe.too_long(path, MAX_DOMAIN_LEN))
    for detail in names.dns1123_subdomain(value.lower()):
        errors.append(fe.invalid(path, value, detail))


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def as_map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def check_pool_name(path: str, value: Any, errors: Errors) -> None:
    if not isinstance(value, str) or not value:
        errors.append(fe.required(path))
        return
    if len(value) > POOL_NAME_MAX:
        errors.append(fe.too_long(path, POOL_NAME_MAX))
    for segment in value.split("/"):
        for detail in names.dns1123_subdomain(segment):
            errors.append(fe.invalid(path, segment, detail))


@functools.lru_cache(maxsize=4096)
def _qualified_name_problems(key: str) -> tuple[tuple[str, object, str], ...]:
    """(reason, value, detail) for an attribute/capacity key; cached, the keys repeat per device."""
    parts = key.split("/")
    problems: list[tuple[str, object, str]] = []

    def identifier(ident: str) -> None:
        if len(ident) > MAX_ID_LEN:
            problems.append((fe.TOO_LONG, None, f"must have at most {MAX_ID_LEN} bytes"))
        problems.extend((fe.INVALID, ident, d) for d in names.c_identifier(ident))

    if len(parts) == 1:
        identifier(parts[0])
    elif len(parts) == 2:
        domain, ident = parts
        if not domain:
            problems.append((fe.INVALID, "", "the domain must not be empty"))
        else:
            if len(domain) > MAX_DOMAIN_LEN:
                problems.append((fe.TOO_LONG, None, f"must have at most {MAX_DOMAIN_LEN} bytes"))
            problems.extend((fe.INVALID, domain, d) for d in names.dns1123_subdomain(domain.lower()))
        if not ident:
            problems.append((fe.INVALID, "", "the name must not be empty"))
        else:
            identifier(ident)
    # more than one slash: accepted, as upstream does today (a known gap there)
    return tuple(problems)


def qualified_name_errors(path: str, key: str, errors: Errors) -> None:
    for reason, value, detail in _qualified_name_problems(key):
        errors.append(fe.FieldError(reason, path, detail, value))


# -- ResourceSlice ---------------------------------------------------------------------------


def validate_slice_spec(spec: dict[str, Any], errors: Errors, path: str = "spec") -> None:
    driver = spec.get("driver")
    driver_name_errors(f"{path}.driver", driver, errors)
    pool = as_map(spec.get("pool"))
    if pool:
        check_pool_name(f"{path}.pool.name", pool.get("name"), errors)
        count = pool.get("resourceSliceCount")
        if isinstance(count, int) and count <= 0:
            errors.append(fe.invalid(f"{path}.pool.resourceSliceCount", count, "must be greater than zero"))
        generation = pool.get("generation")
        if isinstance(generation, int) and generation < 0:
            errors.append(fe.invalid(f"{path}.pool.generation", generation, "must be greater than or equal to zero"))
    set_fields = []
    node_name = spec.get("nodeName")
    if node_name is not None:
        if node_name != "":
            set_fields.append("`nodeName`")
            name_errors(f"{path}.nodeName", node_name, names.dns1123_subdomain, errors)
        else:
            errors.append(fe.invalid(f"{path}.nodeName", "", "must be either unset or set to a non-empty string"))
    if spec.get("nodeSelector") is not None:
        set_fields.append("`nodeSelector`")
        _node_selector_one_term(f"{path}.nodeSelector", spec["nodeSelector"], errors)
    for flag in ("allNodes", "perDeviceNodeSelection"):
        value = spec.get(flag)
        if value is True:
            set_fields.append(f"`{flag}`")
        elif value is False:
            errors.append(fe.invalid(f"{path}.{flag}", False, "must be either unset or set to true"))
    if not set_fields:
        errors.append(fe.required(path, _NODE_UNION_MSG))
    elif len(set_fields) > 1:
        errors.append(
            fe.invalid(path, "{" + ", ".join(set_fields) + "}", f"{_NODE_UNION_MSG}, but multiple fields are set")
        )
    if spec.get("sharedCounters") is not None and spec.get("devices") is not None:
        errors.append(fe.invalid(path, "", "only one of `sharedCounters` or `devices` is allowed"))

    devices = as_list(spec.get("devices"))
    uses_limited = any(isinstance(d, dict) and (d.get("taints") or d.get("consumesCounters")) for d in devices)
    limit = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS if uses_limited else MAX_DEVICES
    if len(devices) > limit:
        errors.append(fe.too_many(f"{path}.devices", len(devices), limit))
    else:
        per_device = spec.get("perDeviceNodeSelection") is True
        seen: set[str] = set()
        for i, device in enumerate(devices):
            if not isinstance(device, dict):
                continue
            dpath = f"{path}.devices[{i}]"
            _device(dpath, device, per_device, errors)
            name = device.get("name")
            if isinstance(name, str):
                if name in seen:
                    errors.append(fe.duplicate(dpath, name))
                seen.add(name)
    _counter_sets(f"{path}.sharedCounters", as_list(spec.get("sharedCounters")), errors)


def _node_selector_one_term(path: str, selector: Any, errors: Errors) -> None:
    terms = as_list(as_map(selector).get("nodeSelectorTerms"))
    if len(terms) != 1:
        errors.append(fe.invalid(f"{path}.nodeSelectorTerms", terms, "must have exactly one node selector term"))


def _device(path: str, device: dict[str, Any], per_device: bool, errors: Errors) -> None:
    name_errors(f"{path}.name", device.get("name"), names.dns1123_label, errors)
    attributes = as_map(device.get("attributes"))
    capacity = as_map(device.get("capacity"))
    combined = len(attributes) + len(capacity)
    if combined > MAX_ATTRIBUTES_AND_CAPACITIES:
        errors.append(
            fe.invalid(
                path,
                combined,
                f"the total number of attributes and capacities must not exceed {MAX_ATTRIBUTES_AND_CAPACITIES}",
            )
        )
    for key, attr in attributes.items():
        kpath = f"{path}.attributes[{key}]"
        if _qualified_name_problems(key):
            qualified_name_errors(kpath, key, errors)
        if type(attr) is dict and len(attr) == 1 and (attr.get("int") is not None or attr.get("bool") is not None):
            continue  # fast path: a single int/bool value has nothing more to check
        _attribute(kpath, attr, errors)
    multi = device.get("allowMultipleAllocations") is True
    for key, cap in capacity.items():
        kpath = f"{path}.capacity[{key}]"
        if _qualified_name_problems(key):
            qualified_name_errors(kpath, key, errors)
        if isinstance(cap, dict) and isinstance(cap.get("requestPolicy"), dict):
            if not multi:
                errors.append(fe.forbidden(f"{kpath}.requestPolicy", "allowMultipleAllocations must be true"))
            else:
                _request_policy(f"{kpath}.requestPolicy", cap.get("value"), cap["requestPolicy"], errors)
    taints = as_list(device.get("taints"))
    if len(taints) > MAX_TAINTS:
        errors.append(fe.too_many(f"{path}.taints", len(taints), MAX_TAINTS))
    else:
        for i, taint in enumerate(taints):
            _taint(f"{path}.taints[{i}]", as_map(taint), errors)
    _consumes_counters(f"{path}.consumesCounters", as_list(device.get("consumesCounters")), errors)
    node_fields = ("nodeName", "nodeSelector", "allNodes")
    if per_device:
        chosen = []
        node_name = device.get("nodeName")
        if node_name is not None:
            if node_name:
                chosen.append("`nodeName`")
                name_errors(f"{path}.nodeName", node_name, names.dns1123_subdomain, errors)
            else:
                errors.append(fe.invalid(f"{path}.nodeName", "", "must not be empty"))
        if device.get("nodeSelector") is not None:
            chosen.append("`nodeSelector`")
        if device.get("allNodes") is True:
            chosen.append("`allNodes`")
        elif device.get("allNodes") is False:
            errors.append(fe.invalid(f"{path}.allNodes", False, "must be either unset or set to true"))
        if not chosen:
            errors.append(fe.required(path, _PER_DEVICE_MSG))
        elif len(chosen) > 1:
            errors.append(fe.invalid(path, "{" + ", ".join(chosen) + "}", _PER_DEVICE_MSG))
    elif any(device.get(f) is not None for f in node_fields):
        errors.append(
            fe.invalid(
                path,
                None,
                "`nodeName`, `nodeSelector` and `allNodes` can only be set if "
                "`perDeviceNodeSelection` is set to true in the ResourceSlice spec",
            )
        )
    for key in ("bindingConditions", "bindingFailureConditions"):
        conditions = as_list(device.get(key))
        if len(conditions) > MAX_BINDING_CONDITIONS:
            errors.append(fe.too_many(f"{path}.{key}", len(conditions), MAX_BINDING_CONDITIONS))


MAX_VALID_VALUES = 10  # resource.CapacityRequestPolicyDiscreteMaxOptions


def _quantity_text(value: Fraction) -> str:
    """Roughly resource.Quantity.String(): binary suffixes when exact, else a plain or milli value."""
    if value.denominator == 1:
        n = value.numerator
        for suffix, power in (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
            if n and n % (1 << power) == 0:
                return f"{n >> power}{suffix}"
        return str(n)
    return f"{math.ceil(value * 1000)}m"


def _request_policy(path: str, value: Any, policy: dict[str, Any], errors: Errors) -> None:
    """validateRequestPolicy of a shareable device's capacity (quantity syntax is checked elsewhere)."""
    rng = policy.get("validRange")
    values = as_list(policy.get("validValues"))
    if values and rng is not None:
        errors.append(
            fe.forbidden(
                path,
                'exactly one policy can be specified, cannot specify "validValues" and "validRange" at the same time',
            )
        )
        return
    if not values and rng is None:
        return
    if policy.get("default") is None:
        errors.append(
            fe.required(
                f"{path}.default", "required when " + ("validValues" if values else "validRange") + " is defined"
            )
        )
        return
    try:
        capacity = parse_quantity(str(value))
        default = parse_quantity(str(policy["default"]))
        options = [parse_quantity(str(v)) for v in values]
        rng = as_map(rng)
        low, high, step = (None if rng.get(k) is None else parse_quantity(str(rng[k])) for k in ("min", "max", "step"))
    except QuantityError:
        return  # reported by the schema
    cap_text = _quantity_text(capacity)
    if values:
        vpath = f"{path}.validValues"
        if len(values) > MAX_VALID_VALUES:
            errors.append(fe.too_many(vpath, len(values), MAX_VALID_VALUES))
            return
        for i in range(len(options) - 1):
            if options[i] > options[i + 1]:
                errors.append(
                    fe.invalid(
                        f"{vpath}[{i + 1}]", _quantity_text(options[i + 1]), "values must be sorted in ascending order"
                    )
                )
        seen: set[Fraction] = set()
        for i, option in enumerate(options):
            if option > capacity:
                errors.append(
                    fe.invalid(
                        f"{vpath}[{i}]", _quantity_text(option), f"option is larger than capacity value: {cap_text}"
                    )
                )
            if option in seen:
                errors.append(fe.duplicate(f"{vpath}[{i}]", str(math.floor(option))))
            seen.add(option)
        if default not in seen:
            errors.append(
                fe.invalid(vpath, _quantity_text(default), "default value is not valid according to the requestPolicy")
            )
        return
    rpath = f"{path}.validRange"
    if low is None:
        return  # `min` is required by the schema
    if low > capacity:
        errors.append(fe.invalid(f"{rpath}.min", _quantity_text(low), f"min is larger than capacity value: {cap_text}"))
    if default < low:
        errors.append(
            fe.invalid(f"{rpath}.min", _quantity_text(default), f"default is less than min: {_quantity_text(low)}")
        )
    if high is not None:
        if low > high:
            errors.append(
                fe.invalid(f"{rpath}.max", _quantity_text(low), f"min is larger than max: {_quantity_text(high)}")
            )
        if high > capacity:
            errors.append(
                fe.invalid(f"{rpath}.max", _quantity_text(high), f"max is larger than capacity value: {cap_text}")
            )
        if default > high:
            errors.append(
                fe.invalid(f"{rpath}.max", _quantity_text(default), f"default is more than max: {_quantity_text(high)}")
            )
    if step is not None:
        if step <= 0:
            errors.append(fe.invalid(f"{rpath}.step", _quantity_text(step), "must be greater than zero"))
            return
        if low + step > capacity:
            errors.append(
                fe.invalid(
                    f"{rpath}.step",
                    _quantity_text(step),
                    f"one step {_quantity_text(low + step)} is larger than capacity value: {cap_text}",
                )
            )
        for amount in (default, high):
            if amount is not None and (math.ceil(amount) - math.ceil(low)) % math.ceil(step):
                errors.append(
                    fe.invalid(
                        f"{rpath}.step",
                        _quantity_text(amount),
                        f"value is not a multiple of a given step ({_quantity_text(step)}) "
                        f"from ({_quantity_text(low)})",
                    )
                )


def _attribute(path: str, attr: Any, errors: Errors) -> None:
    attr = as_map(attr)
    present = [k for k, v in attr.items() if v is not None and k in _VALUE_KINDS]
    if not present:
        errors.append(fe.invalid(path, "", "exactly one value must be specified"))
        return
    if len(present) > 1:
        errors.append(fe.invalid(path, {k: attr[k] for k in present}, "exactly one value must be specified"))
        return
    kind = present[0]
    value = attr[kind]
    if isinstance(value, list):
        if not value:
            errors.append(fe.required(f"{path}.{kind}", "must not be empty"))
        items = [(f"{path}.{kind}[{j}]", item) for j, item in enumerate(value)]
    else:
        items = [(f"{path}.{kind}", value)]
    if not kind.startswith(("string", "version")):
        return
    for ipath, item in items:
        if not isinstance(item, str):
            continue
        if kind.startswith("version"):
            for detail in names.semver(item):
                errors.append(fe.invalid(ipath, item, detail))
        if len(item) > MAX_ATTRIBUTE_VALUE_LEN:
            errors.append(fe.too_long(ipath, MAX_ATTRIBUTE_VALUE_LEN))


def _taint(path: str, taint: dict[str, Any], errors: Errors) -> None:
    name_errors(f"{path}.key", taint.get("key"), names.qualified_name, errors)
    value = taint.get("value")
    if isinstance(value, str) and value:
        for detail in names.label_value(value):
            errors.append(fe.invalid(f"{path}.value", value, detail))
    effect = taint.get("effect")
    if not effect:
        errors.append(fe.required(f"{path}.effect"))
    elif effect not in _TAINT_EFFECTS:
        errors.append(fe.not_supported(f"{path}.effect", effect, _TAINT_EFFECTS))


def _counter_sets(path: str, sets: list[Any], errors: Errors) -> None:
    if len(sets) > MAX_COUNTER_SETS:
        errors.append(fe.too_many(path, len(sets), MAX_COUNTER_SETS))
        return
    seen: set[str] = set()
    for i, counter_set in enumerate(sets):
        counter_set = as_map(counter_set)
        spath = f"{path}[{i}]"
        name = counter_set.get("name")
        name_errors(f"{spath}.name", name, names.dns1123_label, errors)
        _counters(f"{spath}.counters", as_map(counter_set.get("counters")), MAX_COUNTERS_PER_SET, errors)
        if isinstance(name, str):
            if name in seen:
                errors.append(fe.duplicate(spath, name))
            seen.add(name)


def _consumes_counters(path: str, uses: list[Any], errors: Errors) -> None:
    if len(uses) > MAX_CONSUMES_COUNTERS:
        errors.append(fe.too_many(path, len(uses), MAX_CONSUMES_COUNTERS))
        return
    seen: set[str] = set()
    for i, use in enumerate(uses):
        use = as_map(use)
        upath = f"{path}[{i}]"
        counter_set = use.get("counterSet")
        name_errors(f"{upath}.counterSet", counter_set, names.dns1123_label, errors)
        _counters(f"{upath}.counters", as_map(use.get("counters")), MAX_COUNTERS_PER_CONSUMPTION, errors)
        if isinstance(counter_set, str):
            if counter_set in seen:
                errors.append(fe.duplicate(upath, counter_set))
            seen.add(counter_set)


def _counters(path: str, counters: dict[str, Any], limit: int, errors: Errors) -> None:
    if not counters:
        errors.append(fe.required(path))
    elif len(counters) > limit:
        errors.append(fe.too_many(path, len(counters), limit))
    else:
        for key in counters:
            for detail in names.dns1123_label(key):
                errors.append(fe.invalid(f"{path}[{key}]", key, detail))
