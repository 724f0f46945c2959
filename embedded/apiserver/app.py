"""The aiohttp application: the request chain (body limit, authentication, impersonation, authorization:
Node then RBAC) and the routes; the verbs on resources are `http.Handlers`'."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from embedded.apiserver import admission, authn, errors, impersonation, podlogs, rbac, streaming
from embedded.apiserver.http import Handlers
from embedded.apiserver.infohandlers import InfoHandlers
from embedded.apiserver.responses import reply, status_response
from embedded.apiserver.selectors import SelectorError
from shared.logs import get_logger

if TYPE_CHECKING:
    from embedded.apiserver.server import ApiServer

log = get_logger(__name__)
OPEN_PATHS = {"/healthz", "/livez", "/readyz", "/version", "/version/"}


def build_app(server: ApiServer) -> web.Application:
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if (request.content_length or 0) > admission.MAX_REQUEST_BODY:
            return status_response(_too_large(), request)
        user = authn.OPEN_USER
        checked = request.path not in OPEN_PATHS and server.authenticator.enabled
        if checked:
            auth = request.headers.get("Authorization", "")
            found = server.authenticator.authenticate(auth[7:].strip()) if auth.startswith("Bearer ") else None
            if found is None:
                return reply(request, errors.status(401, "Unauthorized", "Unauthorized"), status=401)
            user = found
        if request.path not in OPEN_PATHS and impersonation.asks(request.headers):
            try:
                user = impersonation.acting_user(server.authorizer, user, request.headers)
            except errors.ApiError as err:
                log.info(
                    "impersonation refused",
                    user=user.username,
                    method=request.method,
                    path=request.path,
                    reason=err.message,
                )
                return status_response(err, request)
        if checked:
            attrs = rbac.request_attributes(request.method, request.path, request.query_string)
            allowed, reason = server.authorizer.authorize(user, attrs)
            if not allowed:
                denied = rbac.forbidden(user, attrs, reason)
                log.info(
                    "request forbidden",
                    user=user.username,
                    method=request.method,
                    path=request.path,
                    reason=denied.message,
                )
                return status_response(denied, request)
        token = authn.current_user.set(user)
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except errors.ApiError as err:
            return status_response(err, request)
        except SelectorError as err:
            return status_response(errors.bad_request(str(err)), request)
        except web.HTTPRequestEntityTooLarge:
            return status_response(_too_large(), request)
        finally:
            authn.current_user.reset(token)

    app = web.Application(middlewares=[middleware], client_max_size=admission.MAX_REQUEST_BODY)
    handlers = Handlers(server)
    info = InfoHandlers(server)
    app.router.add_get("/healthz", info.ok)
    app.router.add_get("/livez", info.ok)
    app.router.add_get("/readyz", info.ok)
    app.router.add_get("/version", info.version)
    app.router.add_get("/version/", info.version)  # kubernetes clients ask with the slash
    app.router.add_get("/metrics", info.metrics)
    app.router.add_get("/openapi/v2", info.openapi_v2)
    app.router.add_get("/openapi/v3", info.openapi_v3_index)
    app.router.add_get("/openapi/v3/{path:.*}", info.openapi_v3)
    app.router.add_route("*", "/api", info.api_root)
    app.router.add_route("*", "/apis", info.apis_root)
    app.router.add_post("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", handlers.self_access_review)
    app.router.add_post("/apis/authorization.k8s.io/v1/selfsubjectrulesreviews", handlers.self_rules_review)
    app.router.add_post("/apis/authorization.k8s.io/v1/subjectaccessreviews", handlers.subject_access_review)
    app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", handlers.token_review)
    app.router.add_post("/apis/authentication.k8s.io/v1/selfsubjectreviews", handlers.self_subject_review)
    app.router.add_get("/api/v1/namespaces/{namespace}/pods/{name}/log", podlogs.handler(server))
    for sub in ("exec", "attach"):
        for method in ("GET", "POST"):
            app.router.add_route(
                method, f"/api/v1/namespaces/{{namespace}}/pods/{{name}}/{sub}", streaming.handler(server, sub)
            )
    for method in ("GET", "POST"):
        app.router.add_route(
            method, "/api/v1/namespaces/{namespace}/pods/{name}/portforward", streaming.port_forward_handler(server)
        )
    app.router.add_route("*", "/api/{tail:.*}", handlers.resource)
    app.router.add_route("*", "/apis/{tail:.*}", handlers.resource)
    return app


def _too_large() -> errors.ApiError:
    return errors.ApiError(
        413, "RequestEntityTooLarge", f"Request entity too large: limit is {admission.MAX_REQUEST_BODY}"
    )
