"""Validation of every create and update, as the real API server does it: the upstream OpenAPI
schema of the kind+version (from `kubernetes-validate`, newest bundled Kubernetes that has it),
metadata rules, the resource.k8s.io rules, and immutability on update. Custom resources are
checked against their CRD's openAPIV3Schema with `validate_custom`.

Unknown fields are reported (type UNKNOWN_FIELD), never pruned here; the HTTP layer turns them
into a 400 under fieldValidation=Strict, warnings under Warn, or drops them under Ignore
(`prune_unknown` does the dropping)."""

from __future__ import annotations

import copy
import functools
from typing import Any

from embedded.apiserver import _schemas_cel as cel_rules
from embedded.apiserver import _schemas_dra as dra
from embedded.apiserver import _schemas_dra_claims as dra_claims
from embedded.apiserver import _schemas_errors as fe
from embedded.apiserver import _schemas_names as names
from embedded.apiserver._schemas_check import Check, Compiler
from embedded.apiserver._schemas_errors import (
    UNKNOWN_FIELD,
    FieldError,
    invalid_status,
    strict_decoding_message,
    unknown_fields,
)
from embedded.apiserver._schemas_load import definitions, find_definition
from embedded.apiserver.conversion import GROUP as RESOURCE_GROUP
from embedded.apiserver.conversion import convert_resource
from shared.numbers import decimal_int

__all__ = [
    "UNKNOWN_FIELD",
    "FieldError",
    "invalid_status",
    "is_cluster_scoped",
    "prune_unknown",
    "strict_decoding_message",
    "unknown_fields",
    "validate_custom",
    "validate_object",
]

# Kinds without a namespace. Everything else built in is namespaced.
CLUSTER_SCOPED = frozenset(
    {
        "Namespace",
        "Node",
        "PersistentVolume",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "APIService",
        "DeviceClass",
        "ResourceSlice",
        "DeviceTaintRule",
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "MutatingAdmissionPolicy",
        "MutatingAdmissionPolicyBinding",
        "StorageClass",
        "CSIDriver",
        "CSINode",
        "VolumeAttachment",
        "PriorityClass",
        "IngressClass",
        "RuntimeClass",
        "CertificateSigningRequest",
        "FlowSchema",
        "PriorityLevelConfiguration",
        "IPAddress",
        "ServiceCIDR",
        "VolumeAttributesClass",
        "ClusterTrustBundle",
        "StorageVersionMigration",
    }
)
# Name formats per kind (default: DNS-1123 subdomain).
_NAME_RULE = {
    "Namespace": names.dns1123_label,
    "Service": lambda v: (
        names.dns1123_label(v)
        + (
            []
            if not v or v[0].isalpha()
            else [
                "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
                "regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
            ]
        )
    ),
    "Role": names.path_segment_name,
    "ClusterRole": names.path_segment_name,
    "RoleBinding": names.path_segment_name,
    "ClusterRoleBinding": names.path_segment_name,
}
_ANNOTATIONS_MAX = 256 * 1024


def is_cluster_scoped(kind: str) -> bool:
    return kind in CLUSTER_SCOPED


@functools.cache
def _compiler(k8s_version: str) -> Compiler:
    return Compiler(definitions(k8s_version))


@functools.cache
def _checker(group: str, version: str, kind: str) -> Check | None:
    found = find_definition(group, version, kind)
    if found is None:
        return None
    k8s_version, name = found
    return _compiler(k8s_version).definition(name)


def validate_object(
    group: str, version: str, kind: str, obj: dict[str, Any], old: dict[str, Any] | None = None
) -> list[FieldError]:
    """Every problem with a built-in object (create when `old` is None, update otherwise)."""
    if not isinstance(obj, dict):
        return [fe.FieldError(fe.TYPE_INVALID, "", "the body must be a JSON object", type(obj).__name__)]
    checker = _checker(group, version, kind)
    if checker is None:
        gv = f"{group}/{version}" if group else version
        return [
            fe.FieldError(
                fe.NOT_SUPPORTED,
                "kind",
                f"no schema is known for kind {kind} in {gv}; custom resources are validated with their CRD schema",
                kind,
            )
        ]
    errors: list[FieldError] = []
    checker(obj, "", errors)
    meta = obj.get("metadata")
    if meta is None:
        meta = {}
    if isinstance(meta, dict):
        validate_metadata(kind, meta, errors, old_meta=_meta(old))
    if group == RESOURCE_GROUP:
        _validate_dra(version, kind, obj, old, errors)
    elif group == "apiextensions.k8s.io" and kind == "CustomResourceDefinition":
        _validate_crd_name(obj, errors)
    return errors


def _meta(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    if obj is None:
        return None
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def validate_metadata(
    kind: str,
    meta: dict[str, Any],
    errors: list[FieldError],
    *,
    old_meta: dict[str, Any] | None = None,
    namespaced: bool | None = None,
) -> None:
    """ObjectMeta rules: name or generateName, name format, namespace, labels, annotations, finalizers,
    ownerReferences; on update, name/namespace/uid immutable."""
    rule = _NAME_RULE.get(kind, names.dns1123_subdomain)
    name = meta.get("name")
    generate = meta.get("generateName")
    if name:
        if isinstance(name, str):
            for detail in rule(name):
                errors.append(fe.invalid("metadata.name", name, detail))
    elif generate:
        if isinstance(generate, str):
            # the prefix is checked as a name with its trailing '-' dropped, as the real server does
            prefix = generate[:-1] if generate.endswith("-") else generate
            for detail in rule(prefix or "a"):
                errors.append(fe.invalid("metadata.generateName", generate, detail))
    else:
        errors.append(fe.required("metadata.name", "name or generateName is required"))
    # The namespace comes from the URL and the HTTP layer fills it in (cluster-scoped kinds get it
    # cleared, as the real server's BeforeCreate does); only its format is checked here.
    if namespaced is None:
        namespaced = kind not in CLUSTER_SCOPED
    namespace = meta.get("namespace")
    if namespaced and namespace and isinstance(namespace, str):
        for detail in names.dns1123_label(namespace):
            errors.append(fe.invalid("metadata.namespace", namespace, detail))
    _labels(meta.get("labels"), errors)
    _annotations(meta.get("annotations"), errors)
    finalizers = meta.get("finalizers")
    if isinstance(finalizers, list):
        seen: set[str] = set()
        for i, finalizer in enumerate(finalizers):
            if not isinstance(finalizer, str):
                continue
            for detail in names.qualified_name(finalizer):
                errors.append(fe.invalid(f"metadata.finalizers[{i}]", finalizer, detail))
            if finalizer in seen:
                errors.append(fe.duplicate(f"metadata.finalizers[{i}]", finalizer))
            seen.add(finalizer)
    owners = meta.get("ownerReferences")
    if isinstance(owners, list):
        controllers = 0
        for i, owner in enumerate(owners):
            if not isinstance(owner, dict):
                continue
            for key in ("apiVersion", "kind", "name", "uid"):
                if not owner.get(key):
                    errors.append(fe.required(f"metadata.ownerReferences[{i}].{key}", f"{key} must not be empty"))
            controllers += owner.get("controller") is True
        if controllers > 1:
            errors.append(
                fe.invalid("metadata.ownerReferences", owners, "Only one reference can have Controller set to true.")
            )
    if old_meta is not None:
        for key in ("name", "namespace", "uid"):
            before, after = old_meta.get(key), meta.get(key)
            if key == "uid" and not after:
                continue  # an update may omit uid; the store keeps the old one
            if (before or None) != (after or None):
                errors.append(fe.invalid(f"metadata.{key}", after, "field is immutable"))


def _labels(labels: Any, errors: list[FieldError]) -> None:
    if not isinstance(labels, dict):
        return
    for key, value in labels.items():
        for detail in names.qualified_name(key):
            errors.append(fe.invalid("metadata.labels", key, detail))
        if isinstance(value, str):
            for detail in names.label_value(value):
                errors.append(fe.invalid(f"metadata.labels[{key}]", value, detail))


def _annotations(annotations: Any, errors: list[FieldError]) -> None:
    if not isinstance(annotations, dict):
        return
    total = 0
    for key, value in annotations.items():
        for detail in names.qualified_name(key.lower()):
            errors.append(fe.invalid("metadata.annotations", key, detail))
        total += len(key) + (len(value) if isinstance(value, str) else 0)
    if total > _ANNOTATIONS_MAX:
        errors.append(fe.too_long("metadata.annotations", _ANNOTATIONS_MAX))


def _validate_crd_name(obj: dict[str, Any], errors: list[FieldError]) -> None:
    """The name is `<plural>.<group>`; every x-kubernetes-validations rule must parse."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    versions = spec.get("versions")
    for i, version in enumerate(versions if isinstance(versions, list) else []):
        schema = ((version or {}).get("schema") or {}).get("openAPIV3Schema") if isinstance(version, dict) else None
        cel_rules.rule_syntax_errors(schema, f"spec.versions[{i}].schema.openAPIV3Schema", errors)
    crd_names = spec.get("names")
    plural = crd_names.get("plural") if isinstance(crd_names, dict) else None
    group = spec.get("group")
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    if plural and group and name and name != f"{plural}.{group}":
        errors.append(fe.invalid("metadata.name", name, 'must be spec.names.plural+"."+spec.group'))


def _validate_dra(
    version: str, kind: str, obj: dict[str, Any], old: dict[str, Any] | None, errors: list[FieldError]
) -> None:
    """The resource.k8s.io rules, run on the v1 shape (the real server's internal one), so that
    error paths name v1 fields whatever version was sent, as the real server's do."""
    v1 = obj if version == "v1" else _as_v1(obj)
    old_v1 = None if old is None else (old if _version_of(old) == "v1" else _as_v1(old))
    spec = v1.get("spec") if isinstance(v1.get("spec"), dict) else None
    if kind == "ResourceSlice" and spec is not None:
        dra.validate_slice_spec(spec, errors)
    elif kind == "ResourceClaim":
        # On update the spec is only checked for immutability, as upstream does
        if old_v1 is None and spec is not None:
            dra_claims.validate_claim_spec(spec, errors)
        status = v1.get("status")
        if isinstance(status, dict):
            old_status = (old_v1 or {}).get("status")
            dra_claims.validate_claim_status(
                status,
                errors,
                known=dra_claims.request_names(spec or {}),
                old_status=old_status if isinstance(old_status, dict) else None,
            )
    elif kind == "ResourceClaimTemplate" and spec is not None and old_v1 is None:
        inner = spec.get("spec")
        if isinstance(inner, dict):
            dra_claims.validate_claim_spec(inner, errors, "spec.spec")
        tmeta = spec.get("metadata")
        if isinstance(tmeta, dict):
            _labels(tmeta.get("labels"), errors)
            _annotations(tmeta.get("annotations"), errors)
    elif kind == "DeviceClass" and spec is not None:
        dra_claims.validate_class_spec(spec, errors)
    if old_v1 is not None:
        _immutable(kind, v1, old_v1, errors)


def _version_of(obj: dict[str, Any]) -> str:
    api_version = obj.get("apiVersion")
    return api_version.rpartition("/")[2] if isinstance(api_version, str) else "v1"


def _as_v1(obj: dict[str, Any]) -> dict[str, Any]:
    try:
        return convert_resource(obj, "v1")
    except ValueError:
        return obj


def _immutable(kind: str, new: dict[str, Any], old: dict[str, Any], errors: list[FieldError]) -> None:
    new_spec = new.get("spec") if isinstance(new.get("spec"), dict) else {}
    old_spec = old.get("spec") if isinstance(old.get("spec"), dict) else {}
    if kind in ("ResourceClaim", "ResourceClaimTemplate"):
        # equal specs (a status write, a label change) normalize equal too: the walk only when they differ
        if new_spec != old_spec and _normalized(new_spec) != _normalized(old_spec):
            errors.append(fe.invalid("spec", new_spec, "field is immutable"))
    elif kind == "ResourceSlice":
        for path in (("driver",), ("pool", "name"), ("nodeName",)):
            before, after = _dig(old_spec, path), _dig(new_spec, path)
            if before != after and not (path == ("nodeName",) and not before and not after):
                errors.append(fe.invalid("spec." + ".".join(path), after, "field is immutable"))


def _normalized(value: Any) -> Any:
    """Drops nulls and empty containers, which the real server's typed decoding does not keep."""
    if isinstance(value, dict):
        out = {k: _normalized(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    return value


def _dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


# -- custom resources --------------------------------------------------------------------------

_CUSTOM_CACHE: dict[str, Check] = {}


def _custom_checker(schema: dict[str, Any]) -> Check:
    key = repr(sorted(schema.items())) if len(_CUSTOM_CACHE) < 256 else ""
    check = _CUSTOM_CACHE.get(key) if key else None
    if check is None:
        root = dict(schema)
        props = dict(root.get("properties") or {})
        for implicit in ("apiVersion", "kind"):
            props.setdefault(implicit, {"type": "string"})
        props["metadata"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        root["properties"] = props
        root.setdefault("type", "object")
        check = Compiler(crd=True).compile(root)
        if key:
            _CUSTOM_CACHE[key] = check
    return check


def validate_custom(
    openapi_v3_schema: dict[str, Any],
    obj: dict[str, Any],
    old: dict[str, Any] | None = None,
    *,
    kind: str = "",
    namespaced: bool | None = True,
) -> list[FieldError]:
    """Checks a custom resource against its CRD's structural schema (types, required, enum, bounds,
    lengths, pattern, list-type uniqueness, preserve-unknown-fields, additionalProperties) and its
    metadata. Unknown fields come back as UNKNOWN_FIELD errors (see `prune_unknown`)."""
    if not isinstance(obj, dict):
        return [fe.FieldError(fe.TYPE_INVALID, "", "the body must be a JSON object", type(obj).__name__)]
    errors: list[FieldError] = []
    _custom_checker(openapi_v3_schema)(obj, "", errors)
    cel_rules.check_rules(openapi_v3_schema, obj, old, "", errors)
    meta = obj.get("metadata")
    validate_metadata(
        kind or str(obj.get("kind", "")),
        meta if isinstance(meta, dict) else {},
        errors,
        old_meta=_meta(old),
        namespaced=namespaced,
    )
    return errors


def prune_unknown(obj: dict[str, Any], errors: list[FieldError]) -> dict[str, Any]:
    """A copy of `obj` without the fields named by UNKNOWN_FIELD errors (fieldValidation=Ignore/Warn)."""
    out = copy.deepcopy(obj)
    for error in errors:
        if error.type != UNKNOWN_FIELD:
            continue
        parent: Any = out
        parts = _split_path(error.field)
        for part in parts[:-1]:
            if isinstance(parent, dict):
                parent = parent.get(part)
            elif isinstance(parent, list) and isinstance(part, int) and 0 <= part < len(parent):
                parent = parent[part]
            else:
                parent = None
                break
        if isinstance(parent, dict) and parts:
            parent.pop(parts[-1], None)
    return out


def _split_path(path: str) -> list[str | int]:
    """`spec.devices[3].foo` -> ["spec", "devices", 3, "foo"]; map keys `[k]` become "k"."""
    parts: list[str | int] = []
    token = ""
    i = 0
    while i < len(path):
        ch = path[i]
        if ch == ".":
            if token:
                parts.append(token)
            token = ""
        elif ch == "[":
            if token:
                parts.append(token)
            end = path.index("]", i)
            inner = path[i + 1 : end]
            index = decimal_int(inner)
            parts.append(inner if index is None else index)
            token = ""
            i = end
        else:
            token += ch
        i += 1
    if token:
        parts.append(token)
    return parts
