"""Kubernetes Status objects and the `ApiError` that carries one from the core to the HTTP layer.

Messages follow the real server's wording (`pods "x" not found`, `... the object has been
modified; please apply your changes to the latest version and try again`) because clients and
users match on them.
"""

from __future__ import annotations

from typing import Any

from embedded.apiserver.resources import Resource


def status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
    }
    if details:
        body["details"] = details
    body["code"] = code
    return body


def success_status(res: Resource, name: str, uid: str = "") -> dict[str, Any]:
    details: dict[str, Any] = {"name": name, "group": res.group, "kind": res.plural}
    if uid:
        details["uid"] = uid
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        return status(self.code, self.reason, self.message, self.details)


def _details(res: Resource, name: str) -> dict[str, Any]:
    d: dict[str, Any] = (
        {"name": name, "group": res.group, "kind": res.plural} if name else {"group": res.group, "kind": res.plural}
    )
    if not res.group:
        d.pop("group")
    return d


def not_found(res: Resource, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{res.group_resource} "{name}" not found', _details(res, name))


def namespace_not_found(namespace: str) -> ApiError:
    return ApiError(404, "NotFound", f'namespaces "{namespace}" not found', {"name": namespace, "kind": "namespaces"})


def already_exists(res: Resource, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{res.group_resource} "{name}" already exists', _details(res, name))


def conflict(res: Resource, name: str, why: str | None = None) -> ApiError:
    why = why or "the object has been modified; please apply your changes to the latest version and try again"
    return ApiError(
        409, "Conflict", f'Operation cannot be fulfilled on {res.group_resource} "{name}": {why}', _details(res, name)
    )


def invalid(res: Resource, name: str, causes: list[dict[str, Any]]) -> ApiError:
    kind_group = f"{res.kind}.{res.group}" if res.group else res.kind
    parts = []
    for c in causes:
        field = c.get("field", "")
        parts.append(f"{field}: {c.get('message', '')}" if field else str(c.get("message", "")))
    summary = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    details: dict[str, Any] = {"name": name, "group": res.group, "kind": res.kind, "causes": causes}
    if not res.group:
        details.pop("group")
    return ApiError(422, "Invalid", f'{kind_group} "{name}" is invalid: {summary}', details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def method_not_allowed(message: str = "the server does not allow this method on the requested resource") -> ApiError:
    return ApiError(405, "MethodNotAllowed", message)


def forbidden(res: Resource, name: str, message: str) -> ApiError:
    return ApiError(403, "Forbidden", message, _details(res, name))


def expired(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def unsupported_media(content_type: str) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted "
        f"media types include: application/json-patch+json, application/merge-patch+json, "
        f"application/apply-patch+yaml, application/strategic-merge-patch+json (got {content_type!r})",
    )
