"""The `paths` part of the OpenAPI documents: REST operations per served resource, shaped like the
real server's (operationId, x-kubernetes-action, x-kubernetes-group-version-kind, query parameters).
kubectl reads them: a PATCH operation listing `fieldValidation` means server-side field validation;
one accepting `application/strategic-merge-patch+json` means `kubectl apply` may send a strategic
merge patch built from the OpenAPI v3 schema."""

from __future__ import annotations

from typing import Any

import msgspec

PATCH_TYPES_BUILTIN = (
    "application/apply-patch+yaml",
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
)
PATCH_TYPES_CUSTOM = PATCH_TYPES_BUILTIN[:3]
PATCH_DEF = "io.k8s.apimachinery.pkg.apis.meta.v1.Patch"
DELETE_OPTIONS_DEF = "io.k8s.apimachinery.pkg.apis.meta.v1.DeleteOptions"
STATUS_DEF = "io.k8s.apimachinery.pkg.apis.meta.v1.Status"
WATCH_EVENT_DEF = "io.k8s.apimachinery.pkg.apis.meta.v1.WatchEvent"


class ServedResource(msgspec.Struct, frozen=True):
    """One kind at one version, as far as OpenAPI needs to know it."""

    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool
    subresources: tuple[str, ...] = ()
    schema_name: str = ""  # components key, e.g. io.k8s.api.resource.v1.ResourceSlice
    custom: bool = False


def group_version_path(group: str, version: str) -> str:
    return f"api/{version}" if not group else f"apis/{group}/{version}"


def _camel(group: str, version: str) -> str:
    if not group:
        return "Core" + version.capitalize()
    parts = group.removesuffix(".k8s.io").split(".")
    return "".join(p.capitalize() for p in parts) + version.capitalize()


def _param(name: str, where: str, description: str, kind: str = "string", required: bool = False) -> dict[str, Any]:
    return {
        "name": name,
        "in": where,
        "description": description,
        "required": required or where == "path",
        "schema": {"type": kind, "uniqueItems": True},
    }


_QUERY = {
    "dryRun": _param("dryRun", "query", "When present, indicates that modifications should not be persisted."),
    "fieldManager": _param(
        "fieldManager",
        "query",
        "fieldManager is a name associated with the actor or entity that is making these changes.",
    ),
    "fieldValidation": _param(
        "fieldValidation",
        "query",
        "fieldValidation instructs the server on how to handle "
        "objects in the request containing unknown or duplicate fields: Ignore, Warn or Strict.",
    ),
    "force": _param("force", "query", 'Force is going to "force" Apply requests.', "boolean"),
    "pretty": _param("pretty", "query", "If 'true', then the output is pretty printed."),
    "labelSelector": _param(
        "labelSelector", "query", "A selector to restrict the list of returned objects by their labels."
    ),
    "fieldSelector": _param(
        "fieldSelector", "query", "A selector to restrict the list of returned objects by their fields."
    ),
    "limit": _param("limit", "query", "limit is a maximum number of responses to return for a list call.", "integer"),
    "continue": _param("continue", "query", "The continue option should be set when retrieving more results."),
    "resourceVersion": _param(
        "resourceVersion",
        "query",
        "resourceVersion sets a constraint on what resource versions a request may be served from.",
    ),
    "watch": _param("watch", "query", "Watch for changes to the described resources.", "boolean"),
    "allowWatchBookmarks": _param(
        "allowWatchBookmarks", "query", 'allowWatchBookmarks requests watch events with type "BOOKMARK".', "boolean"
    ),
    "timeoutSeconds": _param("timeoutSeconds", "query", "Timeout for the list/watch call.", "integer"),
    "gracePeriodSeconds": _param(
        "gracePeriodSeconds", "query", "The duration in seconds before the object should be deleted.", "integer"
    ),
    "propagationPolicy": _param(
        "propagationPolicy",
        "query",
        "Whether and how garbage collection will be performed: Orphan, Background or Foreground.",
    ),
}
_LIST_PARAMS = (
    "allowWatchBookmarks",
    "continue",
    "fieldSelector",
    "labelSelector",
    "limit",
    "resourceVersion",
    "timeoutSeconds",
    "watch",
)


def _content(ref: str, types: tuple[str, ...] = ("application/json", "application/yaml")) -> dict[str, Any]:
    return {t: {"schema": {"$ref": ref}} for t in types}


class PathBuilder:
    """Builds OpenAPI v3 path items; `ref(name)` turns a definition name into a `$ref`."""

    def __init__(self, ref_prefix: str) -> None:
        self._prefix = ref_prefix

    def ref(self, name: str) -> str:
        return self._prefix + name

    def paths_for(self, res: ServedResource) -> dict[str, dict[str, Any]]:
        root = "/" + group_version_path(res.group, res.version)
        collection = f"{root}/namespaces/{{namespace}}/{res.plural}" if res.namespaced else f"{root}/{res.plural}"
        item = f"{collection}/{{name}}"
        scope = "Namespaced" if res.namespaced else ""
        paths: dict[str, dict[str, Any]] = {
            collection: self._collection(res, scope),
            item: self._item(res, scope, ""),
        }
        if res.namespaced:
            paths[f"{root}/{res.plural}"] = {
                "get": self._op(
                    res,
                    "list",
                    f"list{_camel(res.group, res.version)}{res.kind}ForAllNamespaces",
                    f"list or watch objects of kind {res.kind}",
                    list_kind=True,
                    params=_LIST_PARAMS,
                ),
                "parameters": [_QUERY["pretty"]],
            }
        for sub in res.subresources:
            if sub in ("status", "scale"):
                paths[f"{item}/{sub}"] = self._item(res, scope, sub)
        return paths

    def _gvk(self, res: ServedResource) -> dict[str, str]:
        return {"group": res.group, "version": res.version, "kind": res.kind}

    def _op(
        self,
        res: ServedResource,
        action: str,
        operation_id: str,
        description: str,
        *,
        list_kind: bool = False,
        params: tuple[str, ...] = (),
        body: str = "",
        patch_types: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        target = self.ref(res.schema_name + ("List" if list_kind else ""))
        op: dict[str, Any] = {
            "tags": [f"{(res.group.removesuffix('.k8s.io').replace('.', '') or 'core')}_{res.version}"],
            "description": description,
            "operationId": operation_id,
            "parameters": [_QUERY[p] for p in params],
            "responses": {
                "200": {"description": "OK", "content": _content(target)},
                "401": {"description": "Unauthorized"},
            },
            "x-kubernetes-action": action,
            "x-kubernetes-group-version-kind": self._gvk(res),
        }
        if body:
            op["requestBody"] = {"content": {"*/*": {"schema": {"$ref": self.ref(body)}}}, "required": True}
        if patch_types:
            op["requestBody"] = {
                "content": {t: {"schema": {"$ref": self.ref(PATCH_DEF)}} for t in patch_types},
                "required": True,
            }
        if action in ("post", "put", "patch"):
            op["responses"]["201"] = {"description": "Created", "content": _content(target)}
        return op

    def _collection(self, res: ServedResource, scope: str) -> dict[str, Any]:
        camel = _camel(res.group, res.version)
        item: dict[str, Any] = {
            "get": self._op(
                res,
                "list",
                f"list{camel}{scope}{res.kind}",
                f"list or watch objects of kind {res.kind}",
                list_kind=True,
                params=_LIST_PARAMS,
            ),
            "post": self._op(
                res,
                "post",
                f"create{camel}{scope}{res.kind}",
                f"create a {res.kind}",
                params=("dryRun", "fieldManager", "fieldValidation"),
                body=res.schema_name,
            ),
            "delete": self._op(
                res,
                "deletecollection",
                f"deletecollection{camel}{scope}{res.kind}",
                f"delete collection of {res.kind}",
                params=("gracePeriodSeconds", "propagationPolicy", "labelSelector", "fieldSelector", "dryRun"),
                body=DELETE_OPTIONS_DEF,
            ),
        }
        item["delete"]["responses"]["200"]["content"] = _content(self.ref(STATUS_DEF))
        item["parameters"] = self._path_params(res, with_name=False)
        return item

    def _item(self, res: ServedResource, scope: str, sub: str) -> dict[str, Any]:
        camel = _camel(res.group, res.version)
        suffix = sub.capitalize()
        what = f"{sub} of the specified {res.kind}" if sub else f"the specified {res.kind}"
        patch_types = PATCH_TYPES_CUSTOM if res.custom else PATCH_TYPES_BUILTIN
        item: dict[str, Any] = {
            "get": self._op(res, "get", f"read{camel}{scope}{res.kind}{suffix}", f"read {what}"),
            "put": self._op(
                res,
                "put",
                f"replace{camel}{scope}{res.kind}{suffix}",
                f"replace {what}",
                params=("dryRun", "fieldManager", "fieldValidation"),
                body=res.schema_name,
            ),
            "patch": self._op(
                res,
                "patch",
                f"patch{camel}{scope}{res.kind}{suffix}",
                f"partially update {what}",
                params=("dryRun", "fieldManager", "fieldValidation", "force"),
                patch_types=patch_types,
            ),
        }
        if not sub:
            item["delete"] = self._op(
                res,
                "delete",
                f"delete{camel}{scope}{res.kind}",
                f"delete a {res.kind}",
                params=("dryRun", "gracePeriodSeconds", "propagationPolicy"),
                body=DELETE_OPTIONS_DEF,
            )
        item["parameters"] = self._path_params(res, with_name=True)
        return item

    def _path_params(self, res: ServedResource, *, with_name: bool) -> list[dict[str, Any]]:
        params = []
        if with_name:
            params.append(_param("name", "path", f"name of the {res.kind}"))
        if res.namespaced:
            params.append(_param("namespace", "path", "object name and auth scope, such as for teams and projects"))
        params.append(_QUERY["pretty"])
        return params


def to_swagger_paths(v3_paths: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The same operations in Swagger 2.0 form (parameters carry `type`, bodies are `in: body`)."""
    out: dict[str, dict[str, Any]] = {}
    for path, item in v3_paths.items():
        new_item: dict[str, Any] = {}
        for key, value in item.items():
            if key == "parameters":
                new_item[key] = [_swagger_param(p) for p in value]
                continue
            op = {k: v for k, v in value.items() if k not in ("requestBody", "responses", "parameters")}
            params = [_swagger_param(p) for p in value.get("parameters", [])]
            body = value.get("requestBody")
            if body:
                content = body["content"]
                op["consumes"] = sorted(content)
                first = next(iter(content.values()))["schema"]["$ref"]
                params.append(
                    {
                        "name": "body",
                        "in": "body",
                        "required": True,
                        "schema": {"$ref": first.replace("#/components/schemas/", "#/definitions/")},
                    }
                )
            op["parameters"] = params
            op["produces"] = ["application/json", "application/yaml"]
            op["schemes"] = ["https"]
            op["responses"] = {
                code: (
                    {
                        "description": r["description"],
                        "schema": {
                            "$ref": next(iter(r["content"].values()))["schema"]["$ref"].replace(
                                "#/components/schemas/", "#/definitions/"
                            )
                        },
                    }
                    if "content" in r
                    else {"description": r["description"]}
                )
                for code, r in value.get("responses", {}).items()
            }
            new_item[key] = op
        out[path] = new_item
    return out


def _swagger_param(param: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in param.items() if k != "schema"}
    schema = param.get("schema") or {}
    out["type"] = schema.get("type", "string")
    if schema.get("uniqueItems"):
        out["uniqueItems"] = True
    return out
