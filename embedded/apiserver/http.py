"""The verbs on resources: URL parsing into (group, version, resource, namespace, name, subresource),
bodies decoded by bodies.py, content negotiation (JSON, Table, PartialObjectMetadata, aggregated
discovery), the mapping of verbs onto the core, and the APIs that store nothing (authapi.py). The
request chain and the routes are `app.py`'s; errors leave as Status objects (`responses.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from embedded.apiserver import (
    authapi,
    authn,
    bodies,
    discovery,
    errors,
    patch,
    protobuf,
    subresources,
    tables,
    versions,
)
from embedded.apiserver.queryparams import query_int, truthy
from embedded.apiserver.requestcount import verb_of
from embedded.apiserver.resources import Resource
from embedded.apiserver.responses import JSON_ONLY, json_response, reply
from embedded.apiserver.selectors import parse_field_selector, parse_label_selector
from embedded.apiserver.storage import deep_copy
from embedded.apiserver.watch import WatchRequest
from shared.logs import get_logger

if TYPE_CHECKING:
    from embedded.apiserver.server import ApiServer

log = get_logger(__name__)
_encode = msgspec.json.encode


@dataclass
class Target:
    group: str
    version: str
    res: Resource | None
    namespace: str | None
    name: str
    subresource: str
    watch_prefix: bool = False


class Handlers:
    def __init__(self, server: ApiServer) -> None:
        self.server = server
        self.core = server.core
        self.registry = server.registry

    # ---- APIs that are not storage

    async def self_access_review(self, request: web.Request) -> web.Response:
        user = authn.current_user.get() or authn.OPEN_USER
        return reply(request, authapi.access_review(self.server.authorizer, user, await self._body(request)), 201)

    async def self_rules_review(self, request: web.Request) -> web.Response:
        user = authn.current_user.get() or authn.OPEN_USER
        return reply(request, authapi.rules_review(self.server.authorizer, user, await self._body(request)), 201)

    async def subject_access_review(self, request: web.Request) -> web.Response:
        # RBAC (`create subjectaccessreviews`) was checked by the middleware, as for any request.
        return json_response(authapi.subject_access_review(self.server.authorizer, await self._body(request)), 201)

    async def self_subject_review(self, request: web.Request) -> web.Response:
        await request.read()  # a SelfSubjectReview asks nothing (kubectl sends it as protobuf): read and dropped
        return reply(request, authapi.self_subject_review(authn.current_user.get() or authn.OPEN_USER), 201)

    async def token_review(self, request: web.Request) -> web.Response:
        # RBAC (`create tokenreviews`) was checked by the middleware, as for any request.
        return reply(request, authapi.token_review(self.server.authenticator, await self._body(request)), 201)

    async def _token_request(self, request: web.Request, target: Target) -> web.Response:
        assert target.res is not None
        sa = self.core.get(target.res, target.namespace or "", target.name)
        body = await self._body(request, target)
        if self.core.admit is not None:  # NodeRestriction: a node's tokens only for pods bound to it
            self.core.admit(
                "CREATE",
                target.res,
                target.version,
                "token",
                target.namespace or "",
                target.name,
                body if isinstance(body, dict) else {},
                None,
            )
        issued = authapi.token_request(self.server.authenticator, sa, body)
        return reply(request, issued, status=201)

    # ---- routing

    def _target(self, request: web.Request) -> Target | web.Response:
        legacy = request.path.startswith("/api/")
        segs = [s for s in request.match_info["tail"].split("/") if s]
        if legacy:
            if not segs:
                return json_response(discovery.api_versions(f"127.0.0.1:{self.server.port}"))
            group, version, rest = "", segs[0], segs[1:]
        else:
            if not segs:  # `/apis/`, as some clients ask
                return json_response(discovery.api_group_list(self.registry))
            if len(segs) == 1:
                doc = discovery.api_group(self.registry, segs[0])
                if doc is None:
                    raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
                return json_response(doc)
            group, version, rest = segs[0], segs[1], segs[2:]
        if not rest:
            doc = discovery.resource_list(self.registry, group, version)
            if doc is None:
                raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
            return json_response(doc)
        watch_prefix = False
        if rest[0] == "watch":
            watch_prefix, rest = True, rest[1:]
        namespace: str | None = None
        if len(rest) >= 3 and rest[0] == "namespaces" and not (group == "" and rest[2] in ("status", "finalize")):
            namespace, rest = rest[1], rest[2:]
        plural = rest[0]
        name = rest[1] if len(rest) > 1 else ""
        sub = rest[2] if len(rest) > 2 else ""
        if len(rest) > 3:
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        res = self.registry.get(group, version, plural)
        if res is None:
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        if namespace is not None and not res.namespaced:
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        if res.namespaced and name and namespace is None:
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub and sub not in res.subresources:
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        return Target(group, version, res, namespace, name, sub, watch_prefix)

    async def resource(self, request: web.Request) -> web.StreamResponse:
        target = self._target(request)
        if isinstance(target, web.Response):
            return target
        method = request.method
        q = request.query
        watching = method == "GET" and not target.name and (target.watch_prefix or truthy(q.get("watch")))
        assert target.res is not None
        self.server.requests.add(
            verb_of(method, bool(target.name), watching), target.group, target.res.plural, target.subresource
        )
        if target.res.is_custom:
            request[JSON_ONLY] = True  # errors too are JSON, as the CRD handler answers
            bodies.json_only(request)
        if method == "GET":
            if target.name:
                return self._get(request, target)
            if target.watch_prefix or truthy(q.get("watch")):
                return await self._watch(request, target)
            return self._list(request, target)
        response = await self._write(request, target, method)
        await self.server.store.persisted()  # an acknowledged write survives a SIGKILL of the server
        return response

    async def _write(self, request: web.Request, target: Target, method: str) -> web.StreamResponse:
        if method == "POST" and not target.name:
            return await self._create(request, target)
        if (
            method == "POST"
            and target.subresource == "token"
            and target.res is not None
            and target.res.key == ("", "serviceaccounts")
        ):
            return await self._token_request(request, target)
        if method == "POST" and target.subresource in ("binding", "eviction"):
            return await self._pod_action(request, target)
        if method == "PUT" and target.name:
            return await self._update(request, target)
        if method == "PATCH" and target.name:
            return await self._patch(request, target)
        if method == "DELETE":
            if target.name:
                return await self._delete(request, target)
            return await self._delete_collection(request, target)
        raise errors.method_not_allowed()

    # ---- encoding

    def _out(self, target: Target, obj: dict[str, Any]) -> dict[str, Any]:
        assert target.res is not None
        return versions.convert(target.res, obj, target.version)

    def _respond_object(
        self,
        request: web.Request,
        target: Target,
        obj: dict[str, Any],
        status: int = 200,
        warnings: list[str] | None = None,
    ) -> web.Response:
        out = self._out(target, obj)
        accept = request.headers.get("Accept", "")
        assert target.res is not None
        if tables.wants_table(accept):
            md = {"resourceVersion": (obj.get("metadata") or {}).get("resourceVersion", "")}
            out = tables.table(target.res, target.version, [out], md, request.query.get("includeObject", "Metadata"))
        elif tables.wants_metadata(accept):
            out = tables.partial_metadata(out)
        if target.subresource == "scale" and target.res is not None:
            out = subresources.scale_of(out)
        return reply(request, out, status=status, warnings=warnings)

    # ---- verbs

    def _get(self, request: web.Request, target: Target) -> web.Response:
        assert target.res is not None
        obj = self.core.get(target.res, target.namespace or "", target.name)
        return self._respond_object(request, target, obj)

    def _selectors(self, request: web.Request, res: Resource) -> tuple[Any, Any]:
        label = parse_label_selector(request.query.get("labelSelector"))
        field = parse_field_selector(request.query.get("fieldSelector"), res.allowed_fields(), res.kind)
        return label, field

    def _list(self, request: web.Request, target: Target) -> web.Response:
        res = target.res
        assert res is not None
        q = request.query
        label, field = self._selectors(request, res)
        limit = query_int(q, "limit") or 0
        page = self.core.list_objects(res, target.namespace, label, field, limit, q.get("continue", ""))
        list_meta: dict[str, Any] = {"resourceVersion": page.resource_version}
        if page.continue_token:
            list_meta["continue"] = page.continue_token
            list_meta["remainingItemCount"] = page.remaining
        accept = request.headers.get("Accept", "")
        list_kind, list_version = f"{res.kind}List", res.api_version(target.version)
        if (
            target.version == res.storage_version
            and protobuf.prefers_protobuf(accept)
            and protobuf.kind_message(list_version, list_kind)
        ):
            store = self.server.store
            try:
                raws = [
                    store.encoded(res.key, k, o, protobuf.object_message)
                    for k, o in zip(page.keys, page.items, strict=True)
                ]
                return web.Response(
                    body=protobuf.encode_list(list_version, list_kind, list_meta, raws),
                    headers={"Content-Type": protobuf.MEDIA_TYPE},
                )
            except protobuf.ProtobufError as exc:
                log.warning("answering JSON: an item does not fit its protobuf message", error=str(exc))
        if (
            target.version == res.storage_version
            and not tables.wants_table(accept)
            and not tables.wants_metadata(accept)
        ):
            # The hot path (informers, LIST of 10k slices): join each object's cached JSON.
            store = self.server.store
            head = _encode(
                {"kind": f"{res.kind}List", "apiVersion": res.api_version(target.version), "metadata": list_meta}
            )
            items_raw = b",".join(store.encoded(res.key, k, o) for k, o in zip(page.keys, page.items, strict=True))
            body_raw = head[:-1] + b',"items":[' + items_raw + b"]}"
            return web.Response(body=body_raw, headers={"Content-Type": "application/json"})
        items = [self._out(target, o) for o in page.items]
        if tables.wants_table(accept):
            body = tables.table(res, target.version, items, list_meta, q.get("includeObject", "Metadata"))
        elif tables.wants_metadata(accept):
            body = {
                "kind": "PartialObjectMetadataList",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": list_meta,
                "items": [tables.partial_metadata(o) for o in items],
            }
        else:
            body = {
                "kind": f"{res.kind}List",
                "apiVersion": res.api_version(target.version),
                "metadata": list_meta,
                "items": items,
            }
        return reply(request, body)

    async def _watch(self, request: web.Request, target: Target) -> web.StreamResponse:
        res = target.res
        assert res is not None
        q = request.query
        label, field = self._selectors(request, res)
        timeout = query_int(q, "timeoutSeconds")
        accept = request.headers.get("Accept", "")
        wr = WatchRequest(
            res=res,
            version=target.version,
            namespace=target.namespace if res.namespaced else None,
            label=label,
            field=field,
            resource_version=q.get("resourceVersion", ""),
            bookmarks=truthy(q.get("allowWatchBookmarks")),
            timeout=float(timeout) if timeout else None,  # 0: the server's own (none here), as upstream
            send_initial=truthy(q.get("sendInitialEvents")),
            as_table=tables.wants_table(accept),
            include_object=q.get("includeObject", "Metadata"),
            metadata_only=tables.wants_metadata(accept),
            protobuf=protobuf.prefers_protobuf(accept, protobuf.METADATA_KINDS) and not res.is_custom,
        )
        return await self.server.hub.serve(request, wr)

    async def _body(self, request: web.Request, target: Target | None = None) -> Any:
        raw = await request.read()
        ctype = request.headers.get("Content-Type", "application/json").split(";")[0].strip()
        if ctype == protobuf.MEDIA_TYPE:
            res = target.res if target is not None else None
            if res is not None and res.is_custom:
                bodies.json_only(request)
            default = (res.api_version(target.version), res.kind) if res is not None and target else ("", "")
            return bodies.checked(bodies.decode_protobuf(raw, default))
        if ctype in ("application/yaml", patch.APPLY_PATCH):
            return bodies.decode_yaml(raw, "the request body is not valid JSON")
        return bodies.decode_json(raw)

    @staticmethod
    def _dry_run(request: web.Request, options: dict[str, Any] | None = None) -> bool:
        """Whether the request is a dry run: `dryRun=All` in the query, or in the body's options (kubectl
        sends DeleteOptions' `dryRun` in the body)."""
        values = [*request.query.getall("dryRun", []), *((options or {}).get("dryRun") or [])]
        for v in values:
            if v != "All":
                raise errors.bad_request(f'dryRun: Unsupported value: "{v}": supported values: "All"')
        return bool(values)

    @staticmethod
    def _field_validation(request: web.Request) -> str:
        value = request.query.get("fieldValidation", "")
        if value not in ("", "Strict", "Warn", "Ignore"):
            raise errors.bad_request(
                f'fieldValidation: Unsupported value: "{value}": supported values: "Ignore", "Strict", "Warn"'
            )
        return value or "Warn"

    async def _admitted(
        self,
        request: web.Request,
        target: Target,
        operation: str,
        write: Callable[[bool], tuple[dict[str, Any], list[str]]],
    ) -> tuple[dict[str, Any], list[str]]:
        """`write(dry_run)`, reviewed first by the validating webhooks whose rules name it: they see the
        object as a dry run of the write makes it (defaulted, validated, policies passed), as kube-apiserver
        calls them after validation and before storage; then the write is made for real."""
        res, hooks, user = target.res, self.server.webhooks, authn.current_user.get()
        assert res is not None
        dry_run = self._dry_run(request)
        if user is None or not hooks.may_apply(operation, res, target.version, target.subresource, res.namespaced):
            return write(dry_run)
        preview, _ = write(True)
        md = preview.get("metadata") or {}
        namespace, name = (md.get("namespace", "") if res.namespaced else ""), md.get("name", "")
        current = self.server.store.get(res.key, (namespace, name)) if operation == "UPDATE" else None
        await hooks.admit(
            user,
            operation,
            res,
            target.version,
            target.subresource,
            namespace,
            name,
            self._out(target, preview),
            self._out(target, current) if current else None,
            dry_run,
        )
        return write(dry_run)

    async def _create(self, request: web.Request, target: Target) -> web.Response:
        assert target.res is not None
        if target.namespace is None and target.res.namespaced:
            raise errors.method_not_allowed()
        body = await self._body(request, target)
        obj, warnings = await self._admitted(request, target, "CREATE", self._creator(request, target, body))
        return self._respond_object(request, target, obj, status=201, warnings=warnings)

    def _creator(
        self, request: web.Request, target: Target, body: Any, field_validation: str | None = None
    ) -> Callable[[bool], tuple[dict[str, Any], list[str]]]:
        """`core.create` of a copy of `body`; a name a dry run generated is kept for the real create."""
        assert target.res is not None
        res, validation = target.res, field_validation or self._field_validation(request)

        def create(dry_run: bool) -> tuple[dict[str, Any], list[str]]:
            obj, warnings = self.core.create(
                res, target.version, target.namespace or "", deep_copy(body) if dry_run else body, dry_run, validation
            )
            if dry_run and isinstance(body, dict) and isinstance(body.get("metadata"), dict):
                body["metadata"].setdefault("name", (obj.get("metadata") or {}).get("name"))
            return obj, warnings

        return create

    async def _update(self, request: web.Request, target: Target) -> web.Response:
        assert target.res is not None
        body = await self._body(request, target)
        if target.subresource == "scale":
            return await self._update_scale(request, target, body)
        if target.subresource == "finalize":
            return self._finalize(request, target, body)
        res, validation = target.res, self._field_validation(request)
        obj, warnings = await self._admitted(
            request,
            target,
            "UPDATE",
            lambda dry_run: self.core.update(
                res,
                target.version,
                target.namespace or "",
                target.name,
                deep_copy(body) if dry_run else body,
                target.subresource,
                dry_run,
                validation,
            ),
        )
        return self._respond_object(request, target, obj, warnings=warnings)

    async def _patch(self, request: web.Request, target: Target) -> web.Response:
        res = target.res
        assert res is not None
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
        if ctype not in (patch.APPLY_PATCH, patch.MERGE_PATCH, patch.JSON_PATCH, patch.STRATEGIC_PATCH):
            raise errors.unsupported_media(ctype)  # before reading the body, as upstream (protobuf included)
        raw = await request.read()
        if ctype == patch.APPLY_PATCH:
            return await self._apply(request, target, raw)
        if target.subresource == "scale":
            current = subresources.scale_of(self._out(target, self.core.get(res, target.namespace or "", target.name)))
            doc = bodies.decode_json(raw, "error decoding patch") if raw else {}
            patched = patch.merge_patch(current, doc) if ctype != patch.JSON_PATCH else patch.json_patch(current, doc)
            return await self._update_scale(request, target, patched)
        validation = self._field_validation(request)
        obj, warnings = await self._admitted(
            request,
            target,
            "UPDATE",
            lambda dry_run: self.core.patch(
                res,
                target.version,
                target.namespace or "",
                target.name,
                ctype,
                raw,
                target.subresource,
                dry_run,
                validation,
            ),
        )
        return self._respond_object(request, target, obj, warnings=warnings)

    async def _apply(self, request: web.Request, target: Target, raw: bytes) -> web.Response:
        """Server-side apply, approximated: create when absent, else merge the applied fields."""
        res = target.res
        assert res is not None
        if not request.query.get("fieldManager"):
            raise errors.bad_request("PATCH, application/apply-patch+yaml requires fieldManager to be set")
        doc = bodies.decode_yaml(raw)
        ns = target.namespace or ""
        if res.namespaced:
            doc.setdefault("metadata", {}).setdefault("namespace", ns)
        exists = res and self.server.store.get(res.key, (ns if res.namespaced else "", target.name)) is not None
        if not exists:
            doc.setdefault("metadata", {})["name"] = target.name
            obj, warnings = await self._admitted(
                request, target, "CREATE", self._creator(request, target, doc, field_validation="Warn")
            )
            return self._respond_object(request, target, obj, status=201, warnings=warnings)
        ctype = patch.MERGE_PATCH if res.is_custom else patch.STRATEGIC_PATCH
        obj, warnings = await self._admitted(
            request,
            target,
            "UPDATE",
            lambda dry_run: self.core.patch(
                res, target.version, ns, target.name, ctype, _encode(doc), target.subresource, dry_run
            ),
        )
        return self._respond_object(request, target, obj, warnings=warnings)

    async def _delete(self, request: web.Request, target: Target) -> web.Response:
        res = target.res
        assert res is not None
        options = await self._delete_options(request)
        obj, gone = self.core.delete(
            res,
            target.namespace or "",
            target.name,
            options.get("propagationPolicy"),
            options.get("gracePeriodSeconds"),
            options.get("preconditions"),
            self._dry_run(request, options),
        )
        if gone and not _returns_deleted_object(res):
            uid = (obj.get("metadata") or {}).get("uid", "")
            return reply(request, errors.success_status(res, target.name, uid))
        return reply(request, self._out(target, obj), status=200 if gone else 202)

    async def _delete_options(self, request: web.Request) -> dict[str, Any]:
        options: dict[str, Any] = {}
        raw = await request.read()
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
        if ctype == protobuf.MEDIA_TYPE and raw:
            options.update(bodies.decode_protobuf(raw, ("meta.k8s.io/v1", "DeleteOptions")))
        elif raw.strip():
            body = bodies.decode_json(raw, "invalid DeleteOptions")
            if isinstance(body, dict):
                options.update(body)
        q = request.query
        if q.get("propagationPolicy"):
            options["propagationPolicy"] = q["propagationPolicy"]
        grace = query_int(q, "gracePeriodSeconds")
        if grace is not None:
            options["gracePeriodSeconds"] = grace
        if options.get("orphanDependents") is True and not options.get("propagationPolicy"):
            options["propagationPolicy"] = "Orphan"
        return options

    async def _delete_collection(self, request: web.Request, target: Target) -> web.Response:
        res = target.res
        assert res is not None
        label, field = self._selectors(request, res)
        options = await self._delete_options(request)
        dry_run = self._dry_run(request, options)
        page = self.core.list_objects(res, target.namespace, label, field)
        deleted = []
        for obj in page.items:
            md = obj.get("metadata") or {}
            try:
                out, _ = self.core.delete(
                    res,
                    md.get("namespace", ""),
                    md["name"],
                    options.get("propagationPolicy"),
                    options.get("gracePeriodSeconds"),
                    None,
                    dry_run,
                )
            except errors.ApiError as err:
                if err.code == 404:
                    continue
                raise
            deleted.append(self._out(target, out))
        return reply(
            request,
            {
                "kind": f"{res.kind}List",
                "apiVersion": res.api_version(target.version),
                "metadata": {"resourceVersion": str(self.server.store.rv)},
                "items": deleted,
            },
        )

    # ---- subresources with their own shapes (subresources.py)

    async def _pod_action(self, request: web.Request, target: Target) -> web.Response:
        body = await self._body(request, target)
        options = (body or {}).get("deleteOptions") or {} if target.subresource == "eviction" else None
        return subresources.pod_action(self.server, request, target, body, self._dry_run(request, options))

    def _finalize(self, request: web.Request, target: Target, body: Any) -> web.Response:
        return subresources.finalize(self.server, request, target, body, self._out, self._dry_run(request))

    async def _update_scale(self, request: web.Request, target: Target, body: Any) -> web.Response:
        return subresources.update_scale(self.server, request, target, body, self._out, self._dry_run(request))


# Kinds whose registry returns the deleted object rather than a Status (ReturnDeletedObject upstream).
_RETURNS_OBJECT = {
    ("", "pods"),
    ("", "services"),
    ("", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "rolebindings"),
    ("networking.k8s.io", "networkpolicies"),
}


def _returns_deleted_object(res: Resource) -> bool:
    return res.is_custom or res.group == "resource.k8s.io" or res.key in _RETURNS_OBJECT
