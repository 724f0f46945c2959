"""The OpenAPI documents the server publishes, built from the upstream definitions that
`kubernetes-validate` bundles (the same ones validation uses) plus CRD schemas:
`/openapi/v3` (index), `/openapi/v3/<api path>` (one OpenAPI 3.0 document per group-version, with
components.schemas keyed like `io.k8s.api.resource.v1.ResourceSlice`) and `/openapi/v2` (Swagger 2.0).
kubectl uses v3 for `explain`, for server-side field validation detection and for `apply`'s
strategic merge patch. Documents are built lazily and cached until the set of resources changes.

Callers may pass `resources`: objects with group, versions, kind, plural, namespaced, subresources
and, for custom kinds, `schemas` {version: openAPIV3Schema} and a truthy `crd_name` (the HTTP
layer's registry entries fit). Without it, the built-in kinds plus CRDs given to `add_crd_schema`."""

from __future__ import annotations

import copy
import functools
import hashlib
import threading
from collections.abc import Iterable
from typing import Any

import msgspec

from embedded.apiserver._schemas_load import definitions, find_definition, schema_versions
from embedded.apiserver._schemas_openapi import (
    LIST_META_DEF,
    OBJECT_META_DEF,
    closure,
    components,
    crd_components,
    crd_schema_name,
    strip_v3_only,
)
from embedded.apiserver._schemas_paths import (
    DELETE_OPTIONS_DEF,
    PATCH_DEF,
    STATUS_DEF,
    WATCH_EVENT_DEF,
    PathBuilder,
    ServedResource,
    group_version_path,
    to_swagger_paths,
)
from embedded.apiserver.resources import BUILTIN

V3_PREFIX = "#/components/schemas/"
V2_PREFIX = "#/definitions/"
_ALWAYS = (STATUS_DEF, DELETE_OPTIONS_DEF, PATCH_DEF, WATCH_EVENT_DEF)

# The subresources that OpenAPI documents as paths of their own.
_DOCUMENTED_SUBRESOURCES = ("status", "scale")

_lock = threading.Lock()
_crds: dict[str, dict[str, Any]] = {}
_crd_generation = 0


class CrdSchemaError(ValueError):
    """A CRD given to add_crd_schema lacks what OpenAPI needs; the message names the field."""


def add_crd_schema(crd: dict[str, Any]) -> None:
    """Publishes a CustomResourceDefinition's served versions (schema, scope, names) in the
    documents used when no `resources` are passed. Replaces an earlier CRD of the same name."""
    global _crd_generation
    spec = crd.get("spec") if isinstance(crd, dict) else None
    if not isinstance(spec, dict):
        raise CrdSchemaError("the CRD has no spec: pass the CustomResourceDefinition object")
    name = str((crd.get("metadata") or {}).get("name") or "")
    names = spec.get("names") or {}
    for field, value in (
        ("metadata.name", name),
        ("spec.group", spec.get("group")),
        ("spec.names.kind", names.get("kind")),
        ("spec.names.plural", names.get("plural")),
    ):
        if not value:
            raise CrdSchemaError(f"the CRD lacks {field}: set it and add the CRD again")
    with _lock:
        _crds[name] = copy.deepcopy(crd)
        _crd_generation += 1


def remove_crd_schema(name: str) -> None:
    global _crd_generation
    with _lock:
        if _crds.pop(name, None) is not None:
            _crd_generation += 1


# -- the served set --------------------------------------------------------------------------


class _Custom(msgspec.Struct, frozen=True):
    resource: ServedResource
    schema: bytes  # JSON of the openAPIV3Schema, so that the whole set is hashable


def _builtin_served() -> list[ServedResource]:
    """Every built-in kind the server serves (resources.BUILTIN, the one list), per version."""
    out = []
    for res in BUILTIN:
        subs = tuple(s for s in res.subresources if s in _DOCUMENTED_SUBRESOURCES)
        for version in res.versions:
            out.append(ServedResource(res.group, version, res.kind, res.plural, res.namespaced, subs))
    return out


def _crd_served(crd: dict[str, Any]) -> list[_Custom]:
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        schema = ((version.get("schema") or {}).get("openAPIV3Schema")) or {"type": "object"}
        subs = tuple(k for k in (version.get("subresources") or {}) if k in ("status", "scale"))
        res = ServedResource(
            spec["group"],
            version["name"],
            names["kind"],
            names["plural"],
            spec.get("scope", "Namespaced") == "Namespaced",
            subs,
            custom=True,
        )
        out.append(_Custom(res, msgspec.json.encode(schema)))
    return out


def _from_objects(resources: Iterable[Any]) -> tuple[tuple[ServedResource, ...], tuple[_Custom, ...]]:
    builtin: list[ServedResource] = []
    custom: list[_Custom] = []
    for res in resources:
        versions = getattr(res, "versions", None) or [getattr(res, "version", "")]
        subs = tuple(s for s in (getattr(res, "subresources", ()) or ()) if s in ("status", "scale"))
        is_custom = bool(getattr(res, "crd_name", "") or getattr(res, "custom", False))
        schemas = getattr(res, "schemas", {}) or {}
        for version in versions:
            served = ServedResource(
                res.group, version, res.kind, res.plural, bool(res.namespaced), subs, custom=is_custom
            )
            if is_custom:
                custom.append(_Custom(served, msgspec.json.encode(schemas.get(version) or {"type": "object"})))
            else:
                builtin.append(served)
    return tuple(builtin), tuple(custom)


def _served(resources: Iterable[Any] | None) -> tuple[tuple[ServedResource, ...], tuple[_Custom, ...]]:
    if resources is not None:
        return _from_objects(resources)
    with _lock:
        crds = list(_crds.values())
    custom: list[_Custom] = []
    for crd in crds:
        custom.extend(_crd_served(crd))
    return tuple(_builtin_served()), tuple(custom)


def _resolve(res: ServedResource) -> tuple[str, ServedResource] | None:
    found = find_definition(res.group, res.version, res.kind)
    if found is None:
        return None
    k8s_version, name = found
    return k8s_version, msgspec.structs.replace(res, schema_name=name)


def _v3_doc(
    group: str, version: str, builtin: tuple[ServedResource, ...], custom: tuple[_Custom, ...]
) -> dict[str, Any]:
    k8s = schema_versions()[0]
    defs = definitions(k8s)
    paths: dict[str, Any] = {}
    roots: list[str] = list(_ALWAYS)
    builder = PathBuilder(V3_PREFIX)
    for res in builtin:
        if (res.group, res.version) != (group, version):
            continue
        resolved = _resolve(res)
        if resolved is None:
            continue
        _, named = resolved
        roots += [named.schema_name, named.schema_name + "List"]
        paths.update(builder.paths_for(named))
    extra: dict[str, Any] = {}
    for item in custom:
        res = item.resource
        if (res.group, res.version) != (group, version):
            continue
        comps = crd_components(res, msgspec.json.decode(item.schema), V3_PREFIX)
        extra.update(comps)
        roots += [OBJECT_META_DEF, LIST_META_DEF]
        named = msgspec.structs.replace(res, schema_name=crd_schema_name(res.group, res.version, res.kind))
        paths.update(builder.paths_for(named))
    if not paths:
        return {}
    schemas = components(defs, closure(defs, roots), V3_PREFIX, True)
    schemas.update(extra)
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": f"v{k8s}.0"},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "BearerToken": {
                    "type": "apiKey",
                    "description": "Bearer Token authentication",
                    "name": "authorization",
                    "in": "header",
                }
            },
        },
        "security": [{"BearerToken": []}],
    }


@functools.lru_cache(maxsize=64)
def _v3_encoded(
    group: str, version: str, builtin: tuple[ServedResource, ...], custom: tuple[_Custom, ...]
) -> tuple[bytes, str]:
    doc = _v3_doc(group, version, builtin, custom)
    body = msgspec.json.encode(doc) if doc else b""
    return body, hashlib.sha512(body).hexdigest().upper()


def _v3_for(
    group: str, version: str, builtin: tuple[ServedResource, ...], custom: tuple[_Custom, ...]
) -> tuple[bytes, str]:
    """Cached per group-version on that group-version's resources only, so a CRD coming or going
    does not rebuild the other documents (nor change their hashes)."""
    own = tuple(r for r in builtin if (r.group, r.version) == (group, version))
    own_custom = tuple(c for c in custom if (c.resource.group, c.resource.version) == (group, version))
    return _v3_encoded(group, version, own, own_custom)


def _group_versions(builtin: tuple[ServedResource, ...], custom: tuple[_Custom, ...]) -> list[tuple[str, str]]:
    seen: dict[tuple[str, str], None] = {}
    for res in builtin:
        if find_definition(res.group, res.version, res.kind) is not None:
            seen[(res.group, res.version)] = None
    for item in custom:
        seen[(item.resource.group, item.resource.version)] = None
    return list(seen)


def openapi_v3_index(resources: Iterable[Any] | None = None) -> dict[str, Any]:
    """The /openapi/v3 discovery document: each group-version's document URL with its content hash."""
    builtin, custom = _served(resources)
    paths = {}
    for group, version in _group_versions(builtin, custom):
        path = group_version_path(group, version)
        _, digest = _v3_for(group, version, builtin, custom)
        paths[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest}"}
    return {"paths": paths}


def _parse_path(path: str) -> tuple[str, str] | None:
    path = path.split("?", 1)[0].strip("/")
    path = path.removeprefix("openapi/v3/")
    parts = path.split("/")
    if len(parts) == 2 and parts[0] == "api":
        return "", parts[1]
    if len(parts) == 3 and parts[0] == "apis":
        return parts[1], parts[2]
    return None


def openapi_v3_document_bytes(path: str, resources: Iterable[Any] | None = None) -> tuple[bytes, str] | None:
    """(JSON body, hash for ETag) of one group-version document, or None when it is not served."""
    parsed = _parse_path(path)
    if parsed is None:
        return None
    builtin, custom = _served(resources)
    if parsed not in _group_versions(builtin, custom):
        return None
    body, digest = _v3_for(parsed[0], parsed[1], builtin, custom)
    return (body, digest) if body else None


def openapi_v3_document(path: str, resources: Iterable[Any] | None = None) -> dict[str, Any] | None:
    """The OpenAPI 3.0 document for `api/v1` or `apis/<group>/<version>` (a leading `/openapi/v3/`
    and a `?hash=` are accepted), or None when that group-version is not served."""
    found = openapi_v3_document_bytes(path, resources)
    if found is None:
        return None
    doc: dict[str, Any] = msgspec.json.decode(found[0])
    return doc


@functools.lru_cache(maxsize=8)
def _v2_encoded(builtin: tuple[ServedResource, ...], custom: tuple[_Custom, ...]) -> bytes:
    k8s = schema_versions()[0]
    defs = definitions(k8s)
    roots: list[str] = list(_ALWAYS)
    v3_paths: dict[str, Any] = {}
    builder = PathBuilder(V3_PREFIX)
    for res in builtin:
        resolved = _resolve(res)
        if resolved is None:
            continue
        _, named = resolved
        roots += [named.schema_name, named.schema_name + "List"]
        v3_paths.update(builder.paths_for(named))
    extra: dict[str, Any] = {}
    for item in custom:
        res = item.resource
        extra.update(crd_components(res, msgspec.json.decode(item.schema), V2_PREFIX))
        roots += [OBJECT_META_DEF, LIST_META_DEF]
        named = msgspec.structs.replace(res, schema_name=crd_schema_name(res.group, res.version, res.kind))
        v3_paths.update(builder.paths_for(named))
    definitions_v2 = components(defs, closure(defs, roots), V2_PREFIX, False)
    for name, schema in extra.items():
        definitions_v2[name] = strip_v3_only(schema)
    doc = {
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": f"v{k8s}.0"},
        "paths": to_swagger_paths(v3_paths),
        "definitions": definitions_v2,
        "securityDefinitions": {
            "BearerToken": {
                "type": "apiKey",
                "name": "authorization",
                "in": "header",
                "description": "Bearer Token authentication",
            }
        },
        "security": [{"BearerToken": []}],
    }
    return msgspec.json.encode(doc)


def openapi_v2_bytes(resources: Iterable[Any] | None = None) -> bytes:
    builtin, custom = _served(resources)
    return _v2_encoded(builtin, custom)


def openapi_v2(resources: Iterable[Any] | None = None) -> dict[str, Any]:
    """The Swagger 2.0 document (/openapi/v2, JSON) with definitions for every served kind.
    client-go asks for it as protobuf: http.py answers that with openapi_proto.document(this)."""
    doc: dict[str, Any] = msgspec.json.decode(openapi_v2_bytes(resources))
    return doc
