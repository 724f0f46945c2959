"""Subresources with shapes of their own: a pod's `binding` and `eviction` (a Status back), a Namespace's
`finalize`, and `scale` (autoscaling/v1 Scale over a workload's spec.replicas)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from embedded.apiserver import errors
from embedded.apiserver.responses import reply
from embedded.apiserver.storage import deep_copy

if TYPE_CHECKING:
    from embedded.apiserver.http import Target
    from embedded.apiserver.server import ApiServer

Converter = Callable[["Target", dict[str, Any]], dict[str, Any]]  # stored object -> the request's version
_SUCCESS = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}


def pod_action(server: ApiServer, request: web.Request, target: Target, body: Any, dry_run: bool) -> web.Response:
    """POST pods/NAME/eviction (the pod deleted with the body's deleteOptions) or pods/NAME/binding."""
    res = target.res
    assert res is not None and res.key == ("", "pods")
    ns = target.namespace or ""
    if target.subresource == "eviction":
        options = (body or {}).get("deleteOptions") or {}
        server.core.delete(
            res,
            ns,
            target.name,
            options.get("propagationPolicy"),
            options.get("gracePeriodSeconds"),
            options.get("preconditions"),
            dry_run,
        )
        return reply(request, dict(_SUCCESS), status=201)
    node = ((body or {}).get("target") or {}).get("name")
    if not node:
        raise errors.invalid(
            res,
            target.name,
            [{"reason": "FieldValueRequired", "field": "target.name", "message": "Required value"}],
        )
    pod = server.core.get(res, ns, target.name)
    if (pod.get("spec") or {}).get("nodeName"):
        raise errors.conflict(
            res, target.name, f'pod {target.name} is already assigned to node "{pod["spec"]["nodeName"]}"'
        )
    if not dry_run:
        server.bind_pod(res, pod, node)
    return reply(request, dict(_SUCCESS), status=201)


def finalize(
    server: ApiServer, request: web.Request, target: Target, body: Any, out: Converter, dry_run: bool
) -> web.Response:
    """PUT namespaces/NAME/finalize: the body's spec.finalizers replace the stored ones."""
    res = target.res
    assert res is not None
    current = server.core.get(res, "", target.name)
    finalizers = ((body or {}).get("spec") or {}).get("finalizers") or []
    updated = {**current, "spec": {**(current.get("spec") or {}), "finalizers": finalizers}}
    if dry_run:
        return reply(request, out(target, updated))
    stored = server.store.put(res.key, ("", target.name), updated)
    server.gc.wake()
    return reply(request, out(target, stored))


def update_scale(
    server: ApiServer, request: web.Request, target: Target, body: Any, out: Converter, dry_run: bool
) -> web.Response:
    """PUT (or a patched) NAME/scale: the Scale's spec.replicas written to the object's spec."""
    res = target.res
    assert res is not None
    replicas = ((body or {}).get("spec") or {}).get("replicas")
    if not isinstance(replicas, int) or replicas < 0:
        raise errors.invalid(
            res,
            target.name,
            [
                {
                    "reason": "FieldValueInvalid",
                    "field": "spec.replicas",
                    "message": "Invalid value: must be a non-negative integer",
                }
            ],
        )
    current = out(target, server.core.get(res, target.namespace or "", target.name))
    new = deep_copy({**current, "spec": {**(current.get("spec") or {}), "replicas": replicas}})
    obj, _ = server.core.update(res, target.version, target.namespace or "", target.name, new, dry_run=dry_run)
    return reply(request, scale_of(out(target, obj)))


def scale_of(obj: dict[str, Any]) -> dict[str, Any]:
    md = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {k: md[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in md},
        "spec": {"replicas": spec.get("replicas", 1)},
        "status": {
            "replicas": status.get("replicas", 0),
            "selector": ",".join(f"{k}={v}" for k, v in sorted(selector.items())),
        },
    }
