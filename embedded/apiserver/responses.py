"""How the API server answers: an object or Status as JSON or protobuf (what the client's Accept asks
for first), with warnings as `Warning` headers."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from embedded.apiserver import errors, protobuf
from shared.logs import get_logger

log = get_logger(__name__)
_encode = msgspec.json.encode
JSON_ONLY = web.RequestKey("json_only", bool)  # set for custom resources: every answer is JSON


def headers_of(content_type: str, warnings: list[str] | None) -> dict[str, str]:
    headers = {"Content-Type": content_type}
    if warnings:
        headers["Warning"] = ", ".join('299 - "' + w.replace('"', '\\"') + '"' for w in warnings)
    return headers


def json_response(
    body: Any, status: int = 200, content_type: str = "application/json", warnings: list[str] | None = None
) -> web.Response:
    return web.Response(body=_encode(body), status=status, headers=headers_of(content_type, warnings))


def reply(request: web.Request, body: Any, status: int = 200, warnings: list[str] | None = None) -> web.Response:
    """An object (or Status) in the encoding the client prefers: protobuf for the built-in kinds when
    its Accept header asks for that first (client-go), JSON otherwise."""
    accept = request.headers.get("Accept", "")
    if (
        not request.get(JSON_ONLY)
        and protobuf.prefers_protobuf(accept, protobuf.METADATA_KINDS)
        and protobuf.can_encode(body)
    ):
        try:
            return web.Response(
                body=protobuf.encode_object(body), status=status, headers=headers_of(protobuf.MEDIA_TYPE, warnings)
            )
        except protobuf.ProtobufError as exc:  # a value its message cannot hold: JSON, which */* accepts
            log.warning("answering JSON: the object does not fit its protobuf message", error=str(exc))
    return json_response(body, status=status, warnings=warnings)


def status_response(err: errors.ApiError, request: web.Request | None = None) -> web.Response:
    if request is not None:
        return reply(request, err.status(), status=err.code)
    return json_response(err.status(), status=err.code)
