"""ResourceClaim specs + DeviceClasses -> the requests the allocator searches (validated, compiled).

Owns claim-level validation with messages that say what to change: exactly one of `exactly` /
`firstAvailable`, a known DeviceClass, `allocationMode` ExactCount (count > 0) or All, selectors
that compile, adminAccess only in namespaces labelled `resource.kubernetes.io/admin-access=true`,
constraint request names that exist. Capacity requests become the equivalent selector (§5.5).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

from embedded.scheduler.cel import CelError, Selector, compile_selector, split_name
from embedded.scheduler.values import QuantityError, parse_quantity

ADMIN_LABEL = "resource.kubernetes.io/admin-access"
MAX_REQUESTS = 32


class ClaimError(ValueError):
    """A claim that no node can satisfy as written; `claim` is `namespace/name`."""

    def __init__(self, claim: str, message: str):
        super().__init__(f"claim {claim}: {message}")
        self.claim = claim
        self.message = message


class Req:
    """One ExactDeviceRequest or one firstAvailable subrequest."""

    __slots__ = (
        "admin",
        "capacity",
        "claim_key",
        "class_name",
        "class_obj",
        "class_selectors",
        "count",
        "mode",
        "name",
        "selectors",
        "signature",
        "tolerations",
        "top",
    )

    def __init__(
        self, claim_key: str, top: str, name: str, body: Mapping[str, Any], class_obj: Mapping[str, Any], admin: bool
    ):
        self.claim_key = claim_key
        self.top = top
        self.name = name
        self.class_name = str(body.get("deviceClassName", ""))
        self.class_obj = class_obj
        self.mode = str(body.get("allocationMode") or "ExactCount")
        self.count = int(body["count"]) if body.get("count") is not None else 1
        self.admin = admin
        self.tolerations: list[dict[str, Any]] = list(body.get("tolerations") or [])
        where = f"request {name}"
        self.class_selectors = _selectors(
            claim_key, f"DeviceClass {self.class_name}", (class_obj.get("spec") or {}).get("selectors") or []
        )
        self.selectors = _selectors(claim_key, where, body.get("selectors") or [])
        self.selectors += _capacity_selectors(claim_key, where, body.get("capacity") or {})
        # capacity.requests by name as written: what each allocation of a shareable device consumes.
        self.capacity: dict[str, Fraction] = {
            str(k): parse_quantity(str(v)) for k, v in ((body.get("capacity") or {}).get("requests") or {}).items()
        }
        # What the per-device CEL verdict depends on: equal signatures, equal verdicts (and reasons).
        signature = "\x00".join(
            [
                self.class_name,
                *(s.expression for s in self.class_selectors),
                "\x01",
                *(s.expression for s in self.selectors),
            ]
        )
        self.signature = sys.intern(signature)  # the same object for every claim alike: identity-fast lookups


class RequestSpec:
    """A top-level request: one alternative (`exactly`) or several in order (`firstAvailable`)."""

    __slots__ = ("alternatives", "first_available", "name")

    def __init__(self, name: str, alternatives: list[Req], first_available: bool):
        self.name = name
        self.alternatives = alternatives
        self.first_available = first_available


class Constraint:
    __slots__ = ("attribute", "requests")

    def __init__(self, requests: list[str], attribute: str):
        self.requests = frozenset(requests)
        self.attribute = attribute

    def applies(self, req: Req) -> bool:
        return not self.requests or req.top in self.requests or req.name in self.requests


class ClaimRequests:
    """One claim, parsed."""

    __slots__ = ("claim", "configs", "constraints", "key", "requests")

    def __init__(
        self,
        key: str,
        claim: Mapping[str, Any],
        requests: list[RequestSpec],
        constraints: list[Constraint],
        configs: list[dict[str, Any]],
    ):
        self.key = key
        self.claim = claim
        self.requests = requests
        self.constraints = constraints
        self.configs = configs


def claim_key(claim: Mapping[str, Any]) -> str:
    md = claim.get("metadata") or {}
    return f"{md.get('namespace', '')}/{md.get('name', '')}"


def _selectors(key: str, where: str, raw: Iterable[Mapping[str, Any]]) -> list[Selector]:
    out: list[Selector] = []
    for i, sel in enumerate(raw):
        expression = (sel.get("cel") or {}).get("expression")
        if not isinstance(expression, str):
            raise ClaimError(key, f"{where}: selector #{i + 1} has no cel.expression")
        try:
            out.append(compile_selector(expression))
        except CelError as exc:
            raise ClaimError(key, f"{where}: selector #{i + 1} does not compile: {exc.message}") from None
    return out


def _capacity_selectors(key: str, where: str, capacity: Mapping[str, Any]) -> list[Selector]:
    out: list[Selector] = []
    for name, value in (capacity.get("requests") or {}).items():
        try:
            parse_quantity(str(value))
        except QuantityError as exc:
            raise ClaimError(key, f"{where}: capacity request {name}: {exc}") from None
        domain, ident = split_name(name, "")
        lookup = f"device.capacity['{domain}']" if domain else "device.capacity[device.driver]"
        out.append(compile_selector(f"'{ident}' in {lookup} && {lookup}.{ident}.compareTo(quantity('{value}')) >= 0"))
    return out


def _class_index(
    classes: Mapping[str, Mapping[str, Any]] | Iterable[Mapping[str, Any]],
) -> dict[str, Mapping[str, Any]]:
    if isinstance(classes, Mapping):
        return dict(classes)
    return {str((c.get("metadata") or {}).get("name", "")): c for c in classes}


def _request_body(
    key: str, top: str, body: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]]
) -> Mapping[str, Any]:
    class_name = body.get("deviceClassName")
    if not class_name:
        raise ClaimError(key, f"request {top} has no deviceClassName")
    if class_name not in classes:
        known = ", ".join(sorted(classes)) or "none"
        raise ClaimError(key, f"request {top}: DeviceClass {class_name!r} does not exist (known: {known})")
    mode = body.get("allocationMode") or "ExactCount"
    if mode not in ("ExactCount", "All"):
        raise ClaimError(key, f"request {top}: allocationMode {mode!r} is unknown; use ExactCount or All")
    count = body.get("count")
    if mode == "ExactCount" and count is not None and (not isinstance(count, int) or count <= 0):
        raise ClaimError(key, f"request {top}: count must be at least 1 (got {count!r})")
    return classes[class_name]


def parse_claim(
    claim: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]], admin_namespaces: set[str]
) -> ClaimRequests:
    key = claim_key(claim)
    namespace = key.split("/", 1)[0]
    devices = (claim.get("spec") or {}).get("devices") or {}
    raw_requests = devices.get("requests") or []
    if len(raw_requests) > MAX_REQUESTS:
        raise ClaimError(key, f"{len(raw_requests)} requests; at most {MAX_REQUESTS} are allowed")
    requests: list[RequestSpec] = []
    names: set[str] = set()
    for raw in raw_requests:
        top = str(raw.get("name", ""))
        if not top or top in names:
            raise ClaimError(key, f"request name {top!r} is empty or used twice")
        names.add(top)
        if bool(raw.get("exactly")) == bool(raw.get("firstAvailable")):
            raise ClaimError(key, f"request {top} must have exactly one of 'exactly' or 'firstAvailable'")
        if raw.get("exactly"):
            body = raw["exactly"]
            admin = bool(body.get("adminAccess"))
            if admin and namespace not in admin_namespaces:
                raise ClaimError(
                    key,
                    f"request {top} asks for adminAccess, which is only allowed in namespaces "
                    f"labelled {ADMIN_LABEL}=true (namespace {namespace} is not)",
                )
            cls = _request_body(key, top, body, classes)
            requests.append(RequestSpec(top, [Req(key, top, top, body, cls, admin)], False))
            continue
        alternatives: list[Req] = []
        for sub in raw["firstAvailable"]:
            sub_name = str(sub.get("name", ""))
            if not sub_name:
                raise ClaimError(key, f"request {top}: a firstAvailable entry has no name")
            cls = _request_body(key, f"{top}/{sub_name}", sub, classes)
            alternatives.append(Req(key, top, f"{top}/{sub_name}", sub, cls, False))
            names.add(f"{top}/{sub_name}")
        requests.append(RequestSpec(top, alternatives, True))
    constraints: list[Constraint] = []
    for i, raw in enumerate(devices.get("constraints") or []):
        scope = [str(r) for r in raw.get("requests") or []]
        unknown = [r for r in scope if r not in names]
        if unknown:
            raise ClaimError(key, f"constraint #{i + 1} names unknown requests {', '.join(unknown)}")
        if raw.get("distinctAttribute"):
            raise ClaimError(
                key,
                f"constraint #{i + 1}: distinctAttribute (consumable capacity) is not "
                "supported by this scheduler; use matchAttribute",
            )
        attribute = raw.get("matchAttribute")
        if not attribute or "/" not in attribute:
            raise ClaimError(
                key,
                f"constraint #{i + 1}: matchAttribute must be a fully qualified name such as gpu.nvidia.com/parentUUID",
            )
        constraints.append(Constraint(scope, str(attribute)))
    configs = [dict(c) for c in devices.get("config") or []]
    return ClaimRequests(key, claim, requests, constraints, configs)


def claim_selectors(
    claims: Iterable[Mapping[str, Any]], classes: Mapping[str, Mapping[str, Any]] | Iterable[Mapping[str, Any]]
) -> list[Selector]:
    """The compiled selectors the claims' requests and their DeviceClasses use (what a plan evaluates);
    one that does not compile is left out: parsing the claim reports it."""
    index = _class_index(classes)
    found: dict[str, Selector] = {}
    for claim in claims:
        for raw in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
            bodies = [raw["exactly"]] if raw.get("exactly") else list(raw.get("firstAvailable") or [])
            for body in bodies:
                cls = index.get(str(body.get("deviceClassName", ""))) or {}
                for sel in [*((cls.get("spec") or {}).get("selectors") or []), *(body.get("selectors") or [])]:
                    expression = (sel.get("cel") or {}).get("expression")
                    if isinstance(expression, str) and expression not in found:
                        try:
                            found[expression] = compile_selector(expression)
                        except CelError:
                            continue
    return list(found.values())


def parse_claims(
    claims: Iterable[Mapping[str, Any]],
    classes: Mapping[str, Mapping[str, Any]] | Iterable[Mapping[str, Any]],
    admin_namespaces: set[str],
) -> list[ClaimRequests]:
    """Every claim parsed; the first malformed one raises ClaimError."""
    index = _class_index(classes)
    return [parse_claim(c, index, admin_namespaces) for c in claims]
