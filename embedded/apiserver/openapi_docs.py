"""The OpenAPI endpoints' documents: built-in kinds from openapi.py (the upstream schemas), plus a
v3 document per CRD group version built from the CRDs' openAPIV3Schema, so `kubectl explain` and
`kubectl apply`'s schema checks see custom resources like a real server serves them."""

from __future__ import annotations

import hashlib
import importlib
from typing import Any

import msgspec

from embedded.apiserver.resources import Registry, Resource

_openapi: Any = None
_loaded = False


def _builtin() -> Any:
    global _openapi, _loaded
    if not _loaded:
        try:
            _openapi = importlib.import_module("embedded.apiserver.openapi")
        except ImportError:
            _openapi = None
        _loaded = True
    return _openapi


def _custom_by_gv(registry: Registry) -> dict[str, list[Resource]]:
    found: dict[str, list[Resource]] = {}
    for res in registry.all():
        if res.is_custom:
            for v in res.versions:
                found.setdefault(f"apis/{res.group}/{v}", []).append(res)
    return found


def v2(registry: Registry) -> dict[str, Any] | None:
    mod = _builtin()
    return mod.openapi_v2() if mod is not None else None


def v3_index(registry: Registry) -> dict[str, Any]:
    mod = _builtin()
    index: dict[str, Any] = mod.openapi_v3_index() if mod is not None else {"paths": {}}
    paths = dict(index.get("paths") or {})
    for gv in _custom_by_gv(registry):
        doc = v3_document(registry, gv) or {}
        digest = hashlib.sha512(msgspec.json.encode(doc)).hexdigest()[:64].upper()
        paths[gv] = {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest}"}
    return {**index, "paths": paths}


def v3_document(registry: Registry, path: str) -> dict[str, Any] | None:
    path = path.strip("/")
    custom = _custom_by_gv(registry).get(path)
    if custom:
        return _crd_document(custom, path.rsplit("/", 1)[-1])
    mod = _builtin()
    return mod.openapi_v3_document(path) if mod is not None else None


def _schema_name(res: Resource, version: str) -> str:
    return ".".join(reversed(res.group.split("."))) + f".{version}.{res.kind}"


def _crd_document(resources: list[Resource], version: str) -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for res in resources:
        name = _schema_name(res, version)
        gvk = [{"group": res.group, "version": version, "kind": res.kind}]
        schema = dict(res.schemas.get(version) or {"type": "object", "x-kubernetes-preserve-unknown-fields": True})
        props = dict(schema.get("properties") or {})
        props.setdefault(
            "apiVersion",
            {
                "type": "string",
                "description": "APIVersion defines the versioned schema of this representation of an object.",
            },
        )
        props.setdefault(
            "kind",
            {
                "type": "string",
                "description": "Kind is a string value representing the REST resource this object represents.",
            },
        )
        props["metadata"] = {
            "allOf": [{"$ref": "#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}],
            "description": "Standard object's metadata.",
        }
        schema["properties"] = props
        schema["x-kubernetes-group-version-kind"] = gvk
        schemas[name] = schema
        list_name = name + "List"
        schemas[list_name] = {
            "type": "object",
            "required": ["items"],
            "properties": {
                "apiVersion": {"type": "string"},
                "kind": {"type": "string"},
                "items": {"type": "array", "items": {"$ref": f"#/components/schemas/{name}"}},
                "metadata": {"$ref": "#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.ListMeta"},
            },
            "x-kubernetes-group-version-kind": [{"group": res.group, "version": version, "kind": res.kind + "List"}],
        }
        base = f"/apis/{res.group}/{version}" + ("/namespaces/{namespace}" if res.namespaced else "")
        ref = {"$ref": f"#/components/schemas/{name}"}
        params = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
        if res.namespaced:
            params.append({"name": "namespace", "in": "path", "required": True, "schema": {"type": "string"}})

        def op(action: str, kind: dict[str, Any] = gvk[0], body: dict[str, Any] = ref) -> dict[str, Any]:
            out: dict[str, Any] = {
                "operationId": f"{action}{kind['kind']}",
                "parameters": [
                    {"name": "dryRun", "in": "query", "schema": {"type": "string", "uniqueItems": True}},
                    {"name": "fieldManager", "in": "query", "schema": {"type": "string", "uniqueItems": True}},
                    {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}},
                ],
                "responses": {"200": {"content": {"application/json": {"schema": body}}}},
                "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": kind,
            }
            return out

        paths[f"{base}/{res.plural}"] = {"get": op("list"), "post": op("post")}
        paths[f"{base}/{res.plural}/{{name}}"] = {
            "get": op("get"),
            "put": op("put"),
            "patch": op("patch"),
            "delete": op("delete"),
            "parameters": params,
        }
        if "status" in res.subresources:
            paths[f"{base}/{res.plural}/{{name}}/status"] = {
                "get": op("get"),
                "put": op("put"),
                "patch": op("patch"),
                "parameters": params,
            }
    meta_schemas = _meta_schemas()
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes CRD Swagger", "version": "v0.1.0"},
        "paths": paths,
        "components": {"schemas": {**meta_schemas, **schemas}},
    }


def _meta_schemas() -> dict[str, Any]:
    """ObjectMeta and friends, from the built-in documents when available."""
    mod = _builtin()
    if mod is not None:
        try:
            doc = mod.openapi_v3_document("api/v1") or {}
            found = (doc.get("components") or {}).get("schemas") or {}
            meta = {k: v for k, v in found.items() if k.startswith("io.k8s.apimachinery.pkg.apis.meta.v1.")}
            if meta:
                return meta
        except Exception:
            pass
    return {
        "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta": {
            "type": "object",
            "description": "ObjectMeta is metadata that all persisted resources must have.",
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "io.k8s.apimachinery.pkg.apis.meta.v1.ListMeta": {
            "type": "object",
            "properties": {"resourceVersion": {"type": "string"}, "continue": {"type": "string"}},
        },
    }
