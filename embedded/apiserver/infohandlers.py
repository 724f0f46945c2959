"""The endpoints that describe the server rather than store anything: health, version, metrics, the OpenAPI
documents (v2 as JSON or protobuf, v3) and API discovery (legacy and aggregated)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web

from embedded.apiserver import discovery, errors, openapi_docs, openapi_proto
from embedded.apiserver.responses import json_response

if TYPE_CHECKING:
    from embedded.apiserver.server import ApiServer


class InfoHandlers:
    def __init__(self, server: ApiServer) -> None:
        self.server = server
        self.registry = server.registry

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def version(self, request: web.Request) -> web.Response:
        return json_response(discovery.SERVER_VERSION)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.server.requests.exposition(), content_type="text/plain")

    async def openapi_v2(self, request: web.Request) -> web.Response:
        doc = openapi_docs.v2(self.registry)
        if doc is None:
            raise errors.ApiError(404, "NotFound", "the OpenAPI v2 document is not available in this build")
        if openapi_proto.wants_protobuf(request.headers.get("Accept", "")):
            body = await asyncio.to_thread(openapi_proto.document, doc)
            return web.Response(body=body, headers={"Content-Type": openapi_proto.RESPONSE_TYPE})
        return json_response(doc)

    async def openapi_v3_index(self, request: web.Request) -> web.Response:
        return json_response(openapi_docs.v3_index(self.registry))

    async def openapi_v3(self, request: web.Request) -> web.Response:
        doc = openapi_docs.v3_document(self.registry, request.match_info["path"])
        if doc is None:
            raise errors.ApiError(404, "NotFound", f"no OpenAPI v3 document for {request.match_info['path']!r}")
        return json_response(doc)

    async def api_root(self, request: web.Request) -> web.Response:
        media = discovery.wants_aggregated(request.headers.get("Accept", ""))
        if media:
            return json_response(discovery.aggregated(self.registry, True, media), content_type=media)
        return json_response(discovery.api_versions(f"127.0.0.1:{self.server.port}"))

    async def apis_root(self, request: web.Request) -> web.Response:
        media = discovery.wants_aggregated(request.headers.get("Accept", ""))
        if media:
            return json_response(discovery.aggregated(self.registry, False, media), content_type=media)
        return json_response(discovery.api_group_list(self.registry))
