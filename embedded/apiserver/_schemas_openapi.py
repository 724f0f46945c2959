"""Turns the upstream JSON-schema definitions (and CRD schemas) into OpenAPI schemas the way the
real server publishes them: one `type`, `$ref`s under the document's prefix (wrapped in allOf when
they carry siblings, in v3), Quantity/IntOrString as strings, no closed objects; plus the
transitive closure of the definitions a document needs."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from embedded.apiserver._schemas_load import ref_name
from embedded.apiserver._schemas_paths import ServedResource

OBJECT_META_DEF = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
LIST_META_DEF = "io.k8s.apimachinery.pkg.apis.meta.v1.ListMeta"
_STRING_LIKE = {
    "io.k8s.apimachinery.pkg.api.resource.Quantity": {"type": "string"},
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString": {"type": "string", "format": "int-or-string"},
}


def convert_schema(schema: Any, prefix: str, v3: bool) -> Any:
    """An upstream JSON-schema definition in OpenAPI form: single `type`, refs under `prefix`,
    `$ref` with siblings wrapped in allOf (v3, as the real server does), no closed objects."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    ref = schema.get("$ref")
    for key, value in schema.items():
        if key in ("$schema", "$id", "$ref"):
            continue
        if key == "type":
            types = [t for t in value if t != "null"] if isinstance(value, list) else [value]
            if len(types) == 1:
                out["type"] = types[0]
        elif key == "properties":
            out[key] = {name: convert_schema(sub, prefix, v3) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            if value is False:
                continue
            out[key] = convert_schema(value, prefix, v3)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [convert_schema(sub, prefix, v3) for sub in value]
        else:
            out[key] = value
    if ref is not None:
        target = prefix + ref_name(ref)
        if not out:
            return {"$ref": target}
        if v3:
            return {"allOf": [{"$ref": target}], **out}
        return {"$ref": target, **out}
    return out


def closure(defs: dict[str, Any], roots: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    stack = [r for r in roots if r in defs]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen[name] = None
        stack.extend(_walk_refs(defs[name]))
    return sorted(seen)


def _walk_refs(node: Any) -> Iterable[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield ref_name(ref)
        for value in node.values():
            yield from _walk_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk_refs(value)


def components(defs: dict[str, Any], names: Iterable[str], prefix: str, v3: bool) -> dict[str, Any]:
    out = {}
    for name in names:
        if name in _STRING_LIKE:
            out[name] = {"description": defs[name].get("description", ""), **_STRING_LIKE[name]}
        else:
            out[name] = convert_schema(defs[name], prefix, v3)
    return out


def crd_schema_name(group: str, version: str, kind: str) -> str:
    """`resource.nvidia.com`, v1beta1, ComputeDomain -> `com.nvidia.resource.v1beta1.ComputeDomain`."""
    return ".".join([*reversed(group.split(".")), version, kind])


def crd_components(res: ServedResource, crd_schema: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    """The kind's and its List's schema for one served version of a CRD."""
    schema = copy.deepcopy(crd_schema)
    props = dict(schema.get("properties") or {})
    props["apiVersion"] = {
        "type": "string",
        "description": "APIVersion defines the versioned schema of this representation of an object.",
    }
    props["kind"] = {
        "type": "string",
        "description": "Kind is a string value representing the REST resource this object represents.",
    }
    props["metadata"] = {"allOf": [{"$ref": prefix + OBJECT_META_DEF}], "description": "Standard object's metadata."}
    schema["properties"] = props
    schema.setdefault("type", "object")
    gvk = {"group": res.group, "version": res.version, "kind": res.kind}
    schema["x-kubernetes-group-version-kind"] = [gvk]
    name = crd_schema_name(res.group, res.version, res.kind)
    list_schema = {
        "description": f"{res.kind}List is a list of {res.kind}",
        "type": "object",
        "required": ["items"],
        "properties": {
            "apiVersion": props["apiVersion"],
            "kind": props["kind"],
            "items": {"type": "array", "items": {"$ref": prefix + name}},
            "metadata": {"allOf": [{"$ref": prefix + LIST_META_DEF}]},
        },
        "x-kubernetes-group-version-kind": [{**gvk, "kind": res.kind + "List"}],
    }
    return {name: schema, name + "List": list_schema}


def strip_v3_only(schema: Any) -> Any:
    """CRD schemas in Swagger 2.0: no `nullable`, no oneOf/anyOf/not (as the real server publishes)."""
    if isinstance(schema, dict):
        return {
            k: strip_v3_only(v)
            for k, v in schema.items()
            if k not in ("nullable", "oneOf", "anyOf", "not", "x-kubernetes-validations")
        }
    if isinstance(schema, list):
        return [strip_v3_only(v) for v in schema]
    return schema
