"""The API semantics between HTTP and storage: create, get, list, update, patch and delete.

Owns what the real server's generic registry does: names and generateName, uid and timestamps,
resourceVersion preconditions (409 on a stale update), generation bumps on spec changes only,
the status subresource kept apart from the main resource, finalizers and deletionTimestamp,
namespace existence, defaulting, validation (422) and conversion to the storage version.
Objects handed out are the stored dicts in the storage version; callers convert and encode them.
"""

from __future__ import annotations

import base64
import datetime as dt
import random
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from embedded.apiserver import bodies, defaults, errors, patch, versions
from embedded.apiserver.resources import Registry, Resource
from embedded.apiserver.selectors import Matcher
from embedded.apiserver.storage import ObjKey, Store, deep_copy
from shared.kube.timestamps import k8s_time

_ALNUM = "bcdfghjklmnpqrstvwxz2456789"
POD_STATUS_METADATA = ("labels", "annotations", "finalizers")  # what a pods/status write may change in metadata


def now() -> str:
    return k8s_time()


def meta(obj: dict[str, Any]) -> dict[str, Any]:
    m = obj.get("metadata")
    return m if isinstance(m, dict) else {}


class ListPage(msgspec.Struct):
    items: list[dict[str, Any]]
    keys: list[ObjKey]
    resource_version: str
    continue_token: str = ""
    remaining: int | None = None


class Core:
    def __init__(self, store: Store, registry: Registry) -> None:
        self.store = store
        self.registry = registry
        # Hooks other modules register: called after a write with (resource, stored object).
        self.on_created: list[Callable[[Resource, dict[str, Any]], None]] = []
        self.before_delete: dict[tuple[str, str], Callable[[Resource, dict[str, Any]], None]] = {}
        self.graceful_pods = True
        # Admission after validation, before storage: (operation, res, version, subresource, namespace,
        # name, object, oldObject) in the request's version; it raises an ApiError to refuse (server.py).
        self.admit: (
            Callable[[str, Resource, str, str, str, str, dict[str, Any] | None, dict[str, Any] | None], None] | None
        ) = None

    # ---- reads

    def get(self, res: Resource, namespace: str, name: str) -> dict[str, Any]:
        obj = self.store.get(res.key, (namespace if res.namespaced else "", name))
        if obj is None:
            raise errors.not_found(res, name)
        return obj

    def list_objects(
        self,
        res: Resource,
        namespace: str | None,
        label: Matcher | None = None,
        field: Matcher | None = None,
        limit: int = 0,
        continue_token: str = "",
    ) -> ListPage:
        start: ObjKey | None = None
        list_rv = self.store.rv
        if continue_token:
            try:
                token = msgspec.json.decode(base64.urlsafe_b64decode(continue_token.encode()))
                start = (token["ns"], token["name"])
                list_rv = int(token["rv"])
            except Exception as exc:
                raise errors.bad_request(f"continue key is not valid: {exc}") from exc
            if list_rv < self.store.oldest_rv:
                raise errors.expired(
                    "The provided continue parameter is too old to display a consistent list result. You can "
                    "start a new list without the continue parameter, or use the continue token in this "
                    "response to retrieve the remainder of the results. Continuing with the provided token "
                    "results in an inconsistent list - objects that were created, modified, or deleted "
                    "between the time the first chunk was returned and now may show up in the list."
                )
        ns = namespace if res.namespaced else None
        items: list[dict[str, Any]] = []
        keys: list[ObjKey] = []
        matched_after = 0
        last_key: ObjKey | None = None
        for key, obj in self.store.items(res.key, ns):
            if start is not None and key <= start:
                continue
            if label is not None and not label(obj):
                continue
            if field is not None and not field(obj):
                continue
            if limit and len(items) >= limit:
                matched_after += 1
                continue
            items.append(obj)
            keys.append(key)
            last_key = key
        page = ListPage(items, keys, str(list_rv))
        if limit and matched_after and last_key is not None:
            raw = msgspec.json.encode({"rv": list_rv, "ns": last_key[0], "name": last_key[1]})
            page.continue_token = base64.urlsafe_b64encode(raw).decode()
            page.remaining = matched_after
        return page

    # ---- create

    def check_namespace(self, res: Resource, namespace: str, name: str) -> None:
        if not res.namespaced:
            return
        ns = self.store.get(("", "namespaces"), ("", namespace))
        if ns is None:
            raise errors.namespace_not_found(namespace)
        if meta(ns).get("deletionTimestamp"):
            raise errors.forbidden(
                res,
                name,
                f'{res.group_resource} "{name}" is forbidden: unable to create new content in namespace '
                f"{namespace} because it is being terminated",
            )

    def create(
        self,
        res: Resource,
        version: str,
        namespace: str,
        body: Any,
        dry_run: bool = False,
        field_validation: str = "Warn",
    ) -> tuple[dict[str, Any], list[str]]:
        """Store a new object from a request body in `version`; returns it and warnings."""
        obj = self._check_body(res, version, body)
        md = obj.setdefault("metadata", {})
        if res.namespaced:
            body_ns = md.get("namespace")
            if body_ns and body_ns != namespace:
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            md["namespace"] = namespace
        else:
            md.pop("namespace", None)
            namespace = ""
        if not md.get("name") and md.get("generateName"):
            md["name"] = self._generate_name(res, namespace, str(md["generateName"]))
        name = str(md.get("name") or "")
        if not name:
            raise errors.invalid(
                res,
                "",
                [
                    {
                        "reason": "FieldValueRequired",
                        "field": "metadata.name",
                        "message": "Required value: name or generateName is required",
                    }
                ],
            )
        self.check_namespace(res, namespace, name)
        for k in ("uid", "resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
            md.pop(k, None)
        md.pop("managedFields", None)
        md["uid"] = str(uuid.uuid4())
        md["creationTimestamp"] = now()
        if res.has_generation:
            md["generation"] = 1
        else:
            md.pop("generation", None)
        if "status" in res.subresources and res.kind != "Node":
            obj.pop("status", None)
        defaults.on_create(res, obj)
        obj, warnings = self._validate(res, version, obj, None, field_validation)
        key = (namespace, name)
        if self.store.get(res.key, key) is not None:
            raise errors.already_exists(res, name)
        if self.admit is not None:
            self.admit("CREATE", res, version, "", namespace, name, obj, None)
        stored = versions.to_storage(res, obj, version)
        if dry_run:
            return stored, warnings
        stored = self.store.put(res.key, key, stored)
        for hook in self.on_created:
            hook(res, stored)
        return stored, warnings

    def _generate_name(self, res: Resource, namespace: str, prefix: str) -> str:
        for _ in range(8):
            name = prefix + "".join(random.choice(_ALNUM) for _ in range(5))
            if self.store.get(res.key, (namespace, name)) is None:
                return name
        raise errors.ApiError(500, "AlreadyExists", f"could not generate a unique name for {prefix!r}")

    def _check_body(self, res: Resource, version: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise errors.bad_request(
                f"the request body must be a JSON object (a {res.kind}), not {type(body).__name__}"
            )
        api_version = res.api_version(version)
        kind = body.get("kind")
        if kind and kind != res.kind:
            raise errors.bad_request(
                f"the API version in the data ({body.get('apiVersion')}) does not match the expected API version "
                f"({api_version}) or the kind {kind!r} is not {res.kind!r}"
            )
        if body.get("apiVersion") and body["apiVersion"] != api_version:
            raise errors.bad_request(
                f"the API version in the data ({body['apiVersion']}) does not match the expected API version "
                f"({api_version})"
            )
        body["kind"] = res.kind
        body["apiVersion"] = api_version
        if "metadata" in body and not isinstance(body["metadata"], dict):
            raise errors.bad_request("metadata must be an object")
        return body

    def _validate(
        self, res: Resource, version: str, obj: dict[str, Any], old: dict[str, Any] | None, mode: str
    ) -> tuple[dict[str, Any], list[str]]:
        """The object to store (unknown fields pruned) and warnings; 422 on invalid, 400 on Strict unknowns.

        `mode` is the fieldValidation parameter: Strict, Warn (the default) or Ignore."""
        found = versions.validate(res, version, obj, old)
        unknown = [e for e in found if getattr(e, "type", "") == "FieldValueUnknown"]
        causes = [e.to_cause() for e in found if getattr(e, "type", "") != "FieldValueUnknown"]
        name = str(meta(obj).get("name", ""))
        if unknown and mode == "Strict":
            raise errors.bad_request(versions.strict_message(res, version, unknown))
        if causes:
            raise errors.invalid(res, name, causes)
        warnings = [f'unknown field "{e.field}"' for e in unknown] if mode != "Ignore" else []
        return versions.prune(obj, unknown), warnings

    # ---- update

    def update(
        self,
        res: Resource,
        version: str,
        namespace: str,
        name: str,
        body: Any,
        subresource: str = "",
        dry_run: bool = False,
        field_validation: str = "Warn",
    ) -> tuple[dict[str, Any], list[str]]:
        """PUT semantics on the main resource or its status subresource."""
        new = self._check_body(res, version, body)
        current = self.get(res, namespace, name)
        new_md = new.setdefault("metadata", {})
        if new_md.get("name") and new_md["name"] != name:
            raise errors.bad_request(
                f"the name of the object ({new_md['name']}) does not match the name on the URL ({name})"
            )
        if res.namespaced and new_md.get("namespace") and new_md["namespace"] != namespace:
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        rv = new_md.get("resourceVersion")
        if rv and str(rv) != meta(current).get("resourceVersion"):
            raise errors.conflict(res, name)
        uid = new_md.get("uid")
        if uid and uid != meta(current).get("uid"):
            raise errors.conflict(
                res,
                name,
                f"Precondition failed: UID in precondition: {uid}, UID in object meta: {meta(current).get('uid')}",
            )
        return self._replace(res, version, current, new, subresource, dry_run, field_validation)

    def _replace(
        self,
        res: Resource,
        version: str,
        current: dict[str, Any],
        new: dict[str, Any],
        subresource: str,
        dry_run: bool,
        field_validation: str = "Warn",
    ) -> tuple[dict[str, Any], list[str]]:
        old = versions.convert(res, current, version)
        old_md = meta(old)
        name = old_md["name"]
        if subresource == "status":
            merged = dict(old)
            merged["metadata"] = dict(old_md)
            if res.key == ("", "pods"):
                # kube-apiserver's pod status strategy resets only spec, deletionTimestamp and ownerReferences (every
                # other kind's resets the whole metadata): a kubelet may write annotations, labels and finalizers
                # along with the pod's status, in one request.
                new_md = new.get("metadata") or {}
                for k in POD_STATUS_METADATA:
                    if k in new_md:
                        merged["metadata"][k] = new_md[k]
                    else:
                        merged["metadata"].pop(k, None)
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
            new = deep_copy(merged)  # never share nested dicts with the stored (immutable) object
        else:
            md = dict(new.get("metadata") or {})
            for k in (
                "name",
                "namespace",
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
            ):
                if k in old_md:
                    md[k] = old_md[k]
                else:
                    md.pop(k, None)
            md.pop("selfLink", None)
            md.pop("managedFields", None)
            new["metadata"] = md
            if "status" in res.subresources:
                if "status" in old:
                    new["status"] = old["status"]
                else:
                    new.pop("status", None)
            if old_md.get("deletionTimestamp"):
                added = set(md.get("finalizers") or []) - set(old_md.get("finalizers") or [])
                if added:
                    raise errors.invalid(
                        res,
                        name,
                        [
                            {
                                "reason": "FieldValueForbidden",
                                "field": "metadata.finalizers",
                                "message": "Forbidden: no new finalizers can be added if the object is being deleted",
                            }
                        ],
                    )
        md = new["metadata"]
        md["resourceVersion"] = old_md.get("resourceVersion")
        if res.has_generation:
            md["generation"] = old_md.get("generation", 1)
            if _spec_changed(res, old, new):
                md["generation"] = int(md.get("generation") or 0) + 1
        defaults.on_update(res, new, old)
        new, warnings = self._validate(res, version, new, old, field_validation)
        if self.admit is not None:
            self.admit(
                "UPDATE",
                res,
                version,
                subresource,
                old_md.get("namespace", "") if res.namespaced else "",
                name,
                new,
                old,
            )
        stored = versions.to_storage(res, new, version)
        if dry_run:
            return stored, warnings
        if _same(stored, current):
            return current, warnings
        key = (old_md.get("namespace", "") if res.namespaced else "", name)
        stored = self.store.put(res.key, key, stored)
        final = self._finish_if_released(res, key, stored)
        return final or stored, warnings

    def _finish_if_released(self, res: Resource, key: ObjKey, obj: dict[str, Any]) -> dict[str, Any] | None:
        md = meta(obj)
        if md.get("deletionTimestamp") and not md.get("finalizers") and not md.get("deletionGracePeriodSeconds"):
            hook = self.before_delete.get(res.key)
            if hook:
                hook(res, obj)
            return self.store.delete(res.key, key)
        return None

    # ---- patch

    def patch(
        self,
        res: Resource,
        version: str,
        namespace: str,
        name: str,
        content_type: str,
        body: bytes,
        subresource: str = "",
        dry_run: bool = False,
        field_validation: str = "Warn",
    ) -> tuple[dict[str, Any], list[str]]:
        current = self.get(res, namespace, name)
        original = deep_copy(versions.convert(res, current, version))
        doc = bodies.decode_json(body, "error decoding patch") if body else None
        try:
            if content_type == patch.MERGE_PATCH:
                patched = patch.merge_patch(original, doc)
            elif content_type == patch.JSON_PATCH:
                patched = patch.json_patch(original, doc)
            elif content_type == patch.STRATEGIC_PATCH:
                if res.is_custom:
                    raise errors.ApiError(
                        415,
                        "UnsupportedMediaType",
                        "strategic merge patch is not supported for custom resources; "
                        "use application/merge-patch+json or application/json-patch+json",
                    )
                patched = patch.strategic_merge_patch(original, doc)
            else:
                raise errors.unsupported_media(content_type)
        except patch.PatchError as exc:
            raise errors.ApiError(422, "Invalid", str(exc)) from exc
        if not isinstance(patched, dict):
            raise errors.bad_request("the patch result is not a JSON object")
        pmd = meta(patched)
        rv = pmd.get("resourceVersion")
        if rv and str(rv) != meta(current).get("resourceVersion"):
            raise errors.conflict(res, name)
        patched = self._check_body(res, version, patched)
        return self._replace(res, version, current, patched, subresource, dry_run, field_validation)

    # ---- delete

    def delete(
        self,
        res: Resource,
        namespace: str,
        name: str,
        propagation: str | None = None,
        grace_seconds: int | None = None,
        preconditions: dict[str, Any] | None = None,
        dry_run: bool = False,
    ) -> tuple[dict[str, Any], bool]:
        """Delete now, or mark for deletion; returns (object, deleted-now)."""
        current = self.get(res, namespace, name)
        if self.admit is not None:
            self.admit("DELETE", res, res.storage_version, "", namespace if res.namespaced else "", name, None, current)
        md = meta(current)
        if preconditions:
            if preconditions.get("uid") and preconditions["uid"] != md.get("uid"):
                raise errors.conflict(
                    res,
                    name,
                    f"Precondition failed: UID in precondition: {preconditions['uid']}, "
                    f"UID in object meta: {md.get('uid')}",
                )
            if preconditions.get("resourceVersion") and preconditions["resourceVersion"] != md.get("resourceVersion"):
                raise errors.conflict(
                    res,
                    name,
                    f"Precondition failed: ResourceVersion in precondition: {preconditions['resourceVersion']}, "
                    f"ResourceVersion in object meta: {md.get('resourceVersion')}",
                )
        if propagation not in (None, "", "Orphan", "Background", "Foreground"):
            raise errors.bad_request(
                f"propagationPolicy: Unsupported value: {propagation!r}: supported values: "
                f'"Foreground", "Background", "Orphan", "nil"'
            )
        finalizers = list(md.get("finalizers") or [])
        if propagation == "Foreground" and "foregroundDeletion" not in finalizers:
            finalizers.append("foregroundDeletion")
        if propagation == "Orphan" and "orphan" not in finalizers:
            finalizers.append("orphan")
        if res.key == ("", "namespaces"):
            return self._delete_namespace(res, current, dry_run), False
        grace = self._pod_grace(res, current, grace_seconds)
        key = (namespace if res.namespaced else "", name)
        if md.get("deletionTimestamp"):
            if res.key == ("", "pods") and grace == 0 and not finalizers:
                if dry_run:
                    return current, True
                return self.store.delete(res.key, key) or current, True
            if finalizers != list(md.get("finalizers") or []) and not dry_run:
                updated = {**current, "metadata": {**md, "finalizers": finalizers}}
                return self.store.put(res.key, key, updated), False
            return current, False
        if finalizers or grace:
            new_md = dict(md)
            stamp = (
                now()
                if not grace
                else (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=grace)).strftime("%Y-%m-%dT%H:%M:%SZ")
            )
            new_md["deletionTimestamp"] = stamp
            new_md["deletionGracePeriodSeconds"] = grace or 0
            if finalizers:
                new_md["finalizers"] = finalizers
            if res.has_generation:
                new_md["generation"] = int(md.get("generation") or 0) + 1
            updated = {**current, "metadata": new_md}
            if dry_run:
                return updated, False
            return self.store.put(res.key, key, updated), False
        if dry_run:
            return current, True
        hook = self.before_delete.get(res.key)
        if hook:
            hook(res, current)
        return self.store.delete(res.key, key) or current, True

    def _pod_grace(self, res: Resource, pod: dict[str, Any], requested: int | None) -> int:
        if res.key != ("", "pods") or not self.graceful_pods:
            return 0
        spec = pod.get("spec") or {}
        phase = (pod.get("status") or {}).get("phase")
        if not spec.get("nodeName") or phase in ("Succeeded", "Failed"):
            return 0
        if self.store.get(("", "nodes"), ("", spec["nodeName"])) is None:
            return 0
        if requested is not None:
            return max(0, int(requested))
        return int(spec.get("terminationGracePeriodSeconds", 30) or 0)

    def _delete_namespace(self, res: Resource, ns: dict[str, Any], dry_run: bool) -> dict[str, Any]:
        md = meta(ns)
        if md.get("deletionTimestamp"):
            return ns
        updated = {**ns, "metadata": {**md, "deletionTimestamp": now(), "deletionGracePeriodSeconds": 0}}
        updated["status"] = {**(ns.get("status") or {}), "phase": "Terminating"}
        if dry_run:
            return updated
        return self.store.put(res.key, ("", md["name"]), updated)

    def remove_finalizer(self, res: Resource, key: ObjKey, finalizer: str) -> None:
        """Drop one finalizer (the garbage collector's and namespace controller's last step)."""
        obj = self.store.get(res.key, key)
        if obj is None:
            return
        md = meta(obj)
        finalizers = [f for f in (md.get("finalizers") or []) if f != finalizer]
        if finalizers == list(md.get("finalizers") or []):
            return
        new_md = {**md, "finalizers": finalizers}
        if not finalizers:
            new_md.pop("finalizers")
        stored = self.store.put(res.key, key, {**obj, "metadata": new_md})
        self._finish_if_released(res, key, stored)


def _spec_changed(res: Resource, old: dict[str, Any], new: dict[str, Any]) -> bool:
    skip = (
        {"metadata", "status", "kind", "apiVersion"}
        if "status" in res.subresources or res.is_custom
        else {"metadata", "kind", "apiVersion"}
    )
    if res.is_custom and "status" not in res.subresources:
        skip = {"metadata", "kind", "apiVersion"}
    keys = (set(old) | set(new)) - skip
    return any(old.get(k) != new.get(k) for k in keys)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """An update that changes nothing is a no-op upstream: no new resourceVersion, no event."""
    return a == b
