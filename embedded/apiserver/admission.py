"""Admission: ValidatingAdmissionPolicies (admissionregistration.k8s.io/v1) with CEL, and the size limits.

Owns which policy applies to a write (its binding's `validationActions` holding Deny,
`matchConstraints`/`matchResources`: resourceRules, excludeResourceRules, namespaceSelector,
objectSelector, then `matchConditions`), the CEL environment a policy sees (`object`,
`oldObject`, `request` with `userInfo`, `namespaceObject`, `variables` in declaration order,
`params` null), the denial as the real server words it (`ValidatingAdmissionPolicy '<p>' with
binding '<b>' denied request: <message>`, code from the validation's reason, 422 by default),
`failurePolicy` for expressions that fail, and the object limits: 1 MiB of ConfigMap/Secret data
(422 as upstream's validation) and the 1.5 MiB etcd limit on any stored object.
CEL is compiled by the `common-expression-language` package the scheduler's selectors use.
"""

from __future__ import annotations

from typing import Any

import cel as _cel
import msgspec

from embedded.apiserver import errors
from embedded.apiserver.authn import UserInfo
from embedded.apiserver.resources import Resource
from embedded.apiserver.selectors import SelectorError, parse_label_selector
from embedded.apiserver.storage import Store
from embedded.scheduler.cel import runtime_message

ADMISSION = "admissionregistration.k8s.io"
MAX_REQUEST_BODY = 3 * 1024 * 1024  # upstream's MaxRequestBodyBytes: 413 above it
MAX_DATA_SIZE = 1024 * 1024  # ConfigMap and Secret data, as upstream's validation (core.MaxSecretSize)
MAX_STORED_OBJECT = 1536 * 1024  # etcd's --max-request-bytes default
_REASON_CODES = {"Unauthorized": 401, "Forbidden": 403, "Invalid": 422, "RequestEntityTooLarge": 413}

_programs: dict[str, Any] = {}


class CelFailure(Exception):
    pass


def _program(expression: str) -> Any:
    found = _programs.get(expression)
    if found is None:
        try:
            found = _cel.compile(expression)
        except (ValueError, RuntimeError) as exc:
            raise CelFailure(f"compilation failed: {str(exc).splitlines()[0]}") from None
        _programs[expression] = found
    return found


def run_cel(expression: str, variables: dict[str, Any]) -> Any:
    program = _program(expression)
    try:
        return program.execute(_cel.Context(variables=variables))
    except Exception as exc:  # the cel package raises several types for runtime errors
        raise CelFailure(runtime_message(exc)) from None


def check_size(res: Resource, name: str, obj: dict[str, Any]) -> None:
    """The limits a real server applies to what it stores."""
    if res.key in (("", "configmaps"), ("", "secrets")):
        total = sum(len(k) + len(v if isinstance(v, str) else str(v)) for k, v in (obj.get("data") or {}).items())
        if res.kind == "ConfigMap":
            total += sum(len(k) + len(str(v)) for k, v in (obj.get("binaryData") or {}).items())
        if total > MAX_DATA_SIZE:
            field = "[]" if res.kind == "ConfigMap" else "data"  # upstream: field.NewPath("") prints as []
            raise errors.invalid(
                res,
                name,
                [
                    {
                        "reason": "FieldValueTooLong",
                        "field": field,
                        "message": f"Too long: must have at most {MAX_DATA_SIZE} bytes",
                    }
                ],
            )
    if len(msgspec.json.encode(obj)) > MAX_STORED_OBJECT:
        raise errors.ApiError(413, "RequestEntityTooLarge", "etcdserver: request is too large")


def rule_matches(
    rule: dict[str, Any], res: Resource, version: str, operation: str, subresource: str, namespaced_request: bool
) -> bool:
    def has(values: list[str] | None, wanted: str) -> bool:
        return bool(values) and ("*" in values or wanted in values)  # type: ignore[operator]

    if not has(rule.get("apiGroups"), res.group) or not has(rule.get("apiVersions"), version):
        return False
    if not has(rule.get("operations"), operation):
        return False
    combined = f"{res.plural}/{subresource}" if subresource else res.plural
    resources = rule.get("resources") or []
    ok = (
        combined in resources
        or "*/*" in resources
        or (not subresource and "*" in resources)
        or (bool(subresource) and f"*/{subresource}" in resources)
        or (bool(subresource) and f"{res.plural}/*" in resources)
    )
    if not ok:
        return False
    scope = str(rule.get("scope", "*"))
    return scope == "*" or (scope == "Namespaced") == namespaced_request


def labels_match(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    if not selector:
        return True
    terms = [f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items()]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key", ""), expr.get("operator", ""), expr.get("values") or []
        if op == "In":
            terms.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            terms.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            terms.append(key)
        elif op == "DoesNotExist":
            terms.append(f"!{key}")
    if not terms:
        return True
    try:
        matcher = parse_label_selector(",".join(terms))
    except SelectorError:
        return False
    return matcher is None or bool(matcher({"metadata": {"labels": labels}}))


class PolicyAdmission:
    """Runs every bound ValidatingAdmissionPolicy on a write; raises the denial as an ApiError."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def admit(
        self,
        user: UserInfo,
        operation: str,
        res: Resource,
        version: str,
        subresource: str,
        namespace: str,
        name: str,
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
    ) -> None:
        bindings = self.store.items((ADMISSION, "validatingadmissionpolicybindings"))
        if not bindings:
            return
        namespace_obj = self.store.get(("", "namespaces"), ("", namespace)) if namespace else None
        request = {
            "kind": {"group": res.group, "version": version, "kind": res.kind},
            "resource": {"group": res.group, "version": version, "resource": res.plural},
            "subResource": subresource,
            "requestKind": {"group": res.group, "version": version, "kind": res.kind},
            "requestResource": {"group": res.group, "version": version, "resource": res.plural},
            "name": name,
            "namespace": namespace,
            "operation": operation,
            "userInfo": user.to_json(),
            "dryRun": False,
        }
        for _, binding in sorted(bindings, key=lambda kv: kv[0]):
            spec = binding.get("spec") or {}
            if "Deny" not in (spec.get("validationActions") or []):
                continue  # Warn and Audit change no outcome here
            policy = self.store.get((ADMISSION, "validatingadmissionpolicies"), ("", spec.get("policyName", "")))
            if policy is None:
                continue
            pspec = policy.get("spec") or {}
            subject = obj if obj is not None else old or {}
            if not self._matches(
                pspec.get("matchConstraints") or {},
                res,
                version,
                operation,
                subresource,
                namespace,
                namespace_obj,
                subject,
            ):
                continue
            if spec.get("matchResources") and not self._matches(
                spec["matchResources"], res, version, operation, subresource, namespace, namespace_obj, subject
            ):
                continue
            env = {
                "object": obj,
                "oldObject": old,
                "request": request,
                "params": None,
                "namespaceObject": namespace_obj,
                "variables": {},
            }
            self._evaluate(policy, binding, env, res, name)

    @staticmethod
    def _matches(
        match: dict[str, Any],
        res: Resource,
        version: str,
        operation: str,
        subresource: str,
        namespace: str,
        namespace_obj: dict[str, Any] | None,
        subject: dict[str, Any],
    ) -> bool:
        rules = match.get("resourceRules") or []
        if not any(rule_matches(r, res, version, operation, subresource, bool(namespace)) for r in rules):
            return False
        if any(
            rule_matches(r, res, version, operation, subresource, bool(namespace))
            for r in match.get("excludeResourceRules") or []
        ):
            return False
        if namespace and match.get("namespaceSelector"):
            labels = ((namespace_obj or {}).get("metadata") or {}).get("labels") or {}
            if not labels_match(match["namespaceSelector"], labels):
                return False
        labels = (subject.get("metadata") or {}).get("labels") or {}
        return labels_match(match.get("objectSelector"), labels)

    def _evaluate(
        self, policy: dict[str, Any], binding: dict[str, Any], env: dict[str, Any], res: Resource, name: str
    ) -> None:
        pspec = policy.get("spec") or {}
        policy_name = (policy.get("metadata") or {}).get("name", "")
        binding_name = (binding.get("metadata") or {}).get("name", "")
        fail_closed = pspec.get("failurePolicy", "Fail") != "Ignore"

        def deny(message: str, reason: str = "Invalid") -> errors.ApiError:
            text = f"ValidatingAdmissionPolicy '{policy_name}' with binding '{binding_name}' denied request: {message}"
            group_resource = f"{res.plural}.{res.group}" if res.group else res.plural
            details: dict[str, Any] = {
                "name": name,
                "group": res.group,
                "kind": res.plural,
                "causes": [{"message": text}],
            }
            if not res.group:
                details.pop("group")
            return errors.ApiError(
                _REASON_CODES.get(reason, 422), reason, f'{group_resource} "{name}" is forbidden: {text}', details
            )

        try:
            for cond in pspec.get("matchConditions") or []:
                if run_cel(cond.get("expression", "false"), env) is not True:
                    return
            for var in pspec.get("variables") or []:
                try:
                    env["variables"] = {**env["variables"], var["name"]: run_cel(var.get("expression", "null"), env)}
                except CelFailure:
                    continue  # an expression that uses it fails in its turn
        except CelFailure as exc:
            if fail_closed:
                raise deny(f"failed to evaluate: {exc}") from None
            return
        for validation in pspec.get("validations") or []:
            expression = validation.get("expression", "")
            try:
                passed = run_cel(expression, env)
            except CelFailure as exc:
                if fail_closed:
                    raise deny(f"expression '{expression}' resulted in error: {exc}") from None
                continue
            if passed is True:
                continue
            message = validation.get("message") or f"failed expression: {expression}"
            if validation.get("messageExpression"):
                try:
                    produced = run_cel(validation["messageExpression"], env)
                    if isinstance(produced, str) and produced.strip():
                        message = produced
                except CelFailure:
                    pass
            raise deny(message, validation.get("reason") or "Invalid")
