"""The dashboard's HTTP API and page (aiohttp): `make_app(state, ...)` and `serve(...)`.

Routes (docs/dashboard.md, "The API"): the page and its static files from the package, `/healthz`,
`/api/fleet`, `/api/stream` (server-sent events: a full `fleet`, then coalesced `delta`s, a `: ping` every
`ping_s`; `telemetry` events carry the tiles' utilisation, all with sparklines after the `fleet`, then each
node's newest samples), the drill-downs `/api/device/<node>/<device>`, `/api/claim/<ns>/<name>`,
`/api/pod/<ns>/<name>/explain`, a node's 10-minute utilisation rings `/api/telemetry/<node>` and the last day's
GPU-hours per namespace `/api/gpu-hours`; the Fleet carries the pods waiting for devices (`pending`, in a delta
when they changed). Every answer is filtered by the viewer's namespaces (auth.py; explain of another namespace's
pod is 403, other tenants' claims in its text unnamed); every error is JSON `{"error": "..."}` that says what
was wrong and what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import msgspec
from aiohttp import web

from services.dashboard import model
from services.dashboard.auth import Authenticator, Unauthorized, Viewer, bearer
from services.dashboard.pending import PendingPod
from services.dashboard.state import FleetState
from shared.kube.rest import ApiError
from shared.logs import get_logger
from shared.numbers import decimal_int

log = get_logger(__name__)
Explainer = Callable[[str, str], Awaitable[str]]  # (namespace, pod) -> `gpu-dra explain` text
Waterfall = Callable[[str], Awaitable[str | None]]  # claim uid -> the trace's waterfall text, or None
STATE_KEY: web.AppKey[FleetState] = web.AppKey("state", FleetState)
_encode = msgspec.json.Encoder().encode

PLACEHOLDER = b"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>gpu-dra fleet</title></head>
<body><h1>gpu-dra fleet</h1><p>The page is not in this build; the API is:
<a href="/api/fleet">/api/fleet</a>, <a href="/api/stream">/api/stream</a>.</p></body></html>
"""
_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".json": "application/json",
    ".ico": "image/x-icon",
}


def error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_encode({"error": message}), content_type="application/json")


def _json(body: Any) -> web.Response:
    return web.Response(body=_encode(body), content_type="application/json")


@functools.cache
def _static(name: str) -> bytes | None:
    """A file of the package's static/ folder, or None (read once: package data does not change)."""
    if "/" in name or name.startswith("."):
        return None
    path = resources.files("services.dashboard").joinpath("static", name)
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


class Api:
    def __init__(
        self,
        state: FleetState,
        auth: Authenticator,
        trace_url_template: str,
        explainer: Explainer | None,
        waterfall: Waterfall | None,
        ping_s: float,
    ) -> None:
        self.state = state
        self.auth = auth
        self.trace_url_template = trace_url_template
        self.explainer = explainer
        self.waterfall = waterfall
        self.ping_s = ping_s

    # ---- who and what -------------------------------------------------------------------------------

    async def viewer(self, request: web.Request) -> Viewer:
        viewer = await self.auth.viewer(bearer(request.headers, request.query), self.state.namespaces())
        namespace = request.query.get("namespace", "")
        if namespace:
            if not viewer.sees(namespace):
                raise web.HTTPForbidden(
                    reason=f"you may not list resourceclaims in namespace {namespace!r}; "
                    "ask for a RoleBinding there or choose another namespace"
                )
            return Viewer(viewer.user, frozenset({namespace}))
        return viewer

    def _namespaces(self, viewer: Viewer) -> list[str]:
        return [ns for ns in self.state.namespaces() if viewer.sees(ns)]

    def _row(self, name: str, viewer: Viewer) -> bytes:
        """A row's JSON as `viewer` sees it; the unfiltered encoding is kept until the row changes."""
        row = self.state.rows[name]
        seen = model.redact(row, viewer.visible)
        if seen is not row:
            return _encode(seen)
        cached = self.state.encoded.get(name)
        if cached is None:
            cached = self.state.encoded[name] = _encode(row)
        return cached

    @staticmethod
    def _with_nodes(head: dict[str, Any], rows: list[bytes]) -> bytes:
        """`head` as JSON with "nodes" (its last key, []) filled with the encoded rows."""
        body = _encode({**head, "nodes": []})
        assert body.endswith(b'"nodes":[]}')
        return body[:-2] + b",".join(rows) + b"]}"

    def _pending(self, viewer: Viewer) -> list[PendingPod]:
        """The waiting pods `viewer` may see, another tenant's claims in their reasons unnamed."""
        if self.state.pending is None:
            return []
        return [
            msgspec.structs.replace(p, reason=model.redact_text(p.reason, viewer.visible))
            for p in self.state.pending.view(viewer.sees)
        ]

    def fleet(self, viewer: Viewer, full: bool = False) -> bytes:
        state = self.state
        head: dict[str, Any] = {
            "version": state.version,
            "generatedAt": state.generated_at,
            "groups": state.groups,
            "counters": state.counters,
            "traceUrlTemplate": self.trace_url_template,
            "namespaces": self._namespaces(viewer),
            "pending": self._pending(viewer),
        }
        if full:
            head["full"] = True
        return self._with_nodes(head, [self._row(n, viewer) for g in state.groups for n in g.nodes])

    def delta(self, viewer: Viewer, names: set[str], pending: bool = False) -> bytes:
        rows = self.state.rows
        head: dict[str, Any] = {
            "version": self.state.version,
            "removed": sorted(n for n in names if n not in rows),
            "counters": self.state.counters,
            "groups": self.state.groups,
        }
        if pending:
            head["pending"] = self._pending(viewer)
        return self._with_nodes(head, [self._row(n, viewer) for n in sorted(names) if n in rows])

    def tiles(self, nodes: set[str] | None, full: bool = False) -> bytes:
        """The utilisation figures of `nodes` (all when None) as the tiles draw them; `full` adds each device's
        SM % points (the sparkline) and says the page to replace what it holds, else the page appends."""
        store = self.state.telemetry
        picked = None if nodes is None else sorted(nodes)
        return _encode({"full": full, "nodes": store.tiles(picked, with_spark=full)})

    # ---- routes ---------------------------------------------------------------------------------------

    async def index(self, request: web.Request) -> web.Response:
        return web.Response(body=_static("index.html") or PLACEHOLDER, content_type="text/html")

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = _static(name)
        if body is None:
            return error(404, f"no static file {name!r} in this build")
        suffix = name[name.rfind(".") :] if "." in name else ""
        return web.Response(body=body, content_type=_TYPES.get(suffix, "application/octet-stream"))

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def get_fleet(self, request: web.Request) -> web.Response:
        return web.Response(body=self.fleet(await self.viewer(request)), content_type="application/json")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        viewer = await self.viewer(request)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        watcher = self.state.add_viewer()
        try:
            await response.write(b"event: fleet\ndata: " + self.fleet(viewer, full=True) + b"\n\n")
            if self.state.telemetry.nodes:
                await response.write(b"event: telemetry\ndata: " + self.tiles(None, full=True) + b"\n\n")
            while True:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(watcher.wake.wait(), self.ping_s)
                if watcher.wake.is_set():
                    sampled = watcher.take_telemetry()
                    names, pending = watcher.take()
                    if sampled:
                        await response.write(b"event: telemetry\ndata: " + self.tiles(sampled) + b"\n\n")
                    if names or pending or not sampled:
                        await response.write(b"event: delta\ndata: " + self.delta(viewer, names, pending) + b"\n\n")
                else:
                    await response.write(b": ping\n\n")
                    try:  # grants change (and the token may expire): asked again, from the cache mostly
                        viewer = await self.viewer(request)
                    except (Unauthorized, web.HTTPForbidden):
                        break
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.state.remove_viewer(watcher)
        return response

    async def device(self, request: web.Request) -> web.Response:
        viewer = await self.viewer(request)
        node, name = request.match_info["node"], request.match_info["device"]
        row = self.state.rows.get(node)
        if row is None:
            return error(404, f"no node {node!r} with GPUs; GET /api/fleet lists the nodes")
        row = model.redact(row, viewer.visible)
        device = next((d for d in row.devices if d.name == name), None)
        if device is None:
            return error(
                404, f"node {node!r} has no device {name!r}; its devices are: {', '.join(d.name for d in row.devices)}"
            )
        events = [
            {
                "time": e.time,
                "type": e.type,
                "summary": e.summary if viewer.sees(e.namespace) or not e.namespace else "another tenant's claim",
            }
            for e in self.state.events(node, name)
        ]
        return _json({"device": device, "node": node, "events": events})

    async def telemetry(self, request: web.Request) -> web.Response:
        await self.viewer(request)
        node = request.match_info["node"]
        view = self.state.telemetry.node_view(node)
        if view is None:
            return error(
                404,
                f"no utilisation from node {node!r} in the last 10 minutes; its discovery publishes it every "
                "--telemetry-interval seconds (0: off)",
            )
        return _json(view)

    async def gpu_hours(self, request: web.Request) -> web.Response:
        viewer = await self.viewer(request)
        hours = self.state.gpu_hours
        rows = [r for r in hours.report() if viewer.sees(r.namespace)]
        return _json({"windowS": hours.window_s, "namespaces": rows})

    async def claim(self, request: web.Request) -> web.Response:
        viewer = await self.viewer(request)
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        if not viewer.sees(namespace):
            return error(403, f"you may not list resourceclaims in namespace {namespace!r}")
        claim = self.state.claims.get(namespace, name)
        if claim is None:
            return error(
                404,
                f"no resourceclaim {namespace}/{name}; check the name with kubectl get resourceclaims -n {namespace}",
            )
        md = claim.get("metadata") or {}
        trace_id = self.state.claim_trace_id(claim)
        trace_url = (
            self.trace_url_template.replace("{traceId}", trace_id) if trace_id and self.trace_url_template else ""
        )
        waterfall = await self.waterfall(str(md.get("uid") or "")) if self.waterfall is not None else None
        return _json(
            {
                "claim": {
                    "namespace": namespace,
                    "name": name,
                    "uid": md.get("uid", ""),
                    "pods": model.claim_pods(claim),
                    "devices": [{"node": n, "device": d} for n, d in self.state.claim_nodes(claim)],
                },
                "traceId": trace_id,
                "traceUrl": trace_url,
                "waterfall": waterfall,
            }
        )

    async def explain(self, request: web.Request) -> web.Response:
        viewer = await self.viewer(request)
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        if not viewer.sees(namespace):
            return error(403, f"you may not list resourceclaims in namespace {namespace!r}")
        if not await self.state.has_pod(namespace, name):
            return error(404, f"no pod {namespace}/{name}; check the name with kubectl get pods -n {namespace}")
        if self.explainer is None:
            return error(
                501,
                "explain needs the local-cluster tools, which this install lacks (pip install "
                f"'gpu-dra[embedded]'); run `gpu-dra explain pod {namespace}/{name}` where they are",
            )
        return _json({"text": model.redact_text(await self.explainer(namespace, name), viewer.visible)})


@web.middleware
async def json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every failure as JSON {"error": ...}: 401 for a token refused, the HTTP errors as they are."""
    try:
        return await handler(request)
    except Unauthorized as exc:
        return error(401, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        text = exc.reason if exc.status != 404 else f"no such path {request.path!r}; the API is under /api/"
        return error(exc.status, text)
    except ApiError as exc:
        log.error("API server refused a dashboard request", path=request.path, error=str(exc))
        return error(502, f"the Kubernetes API refused the dashboard: {exc}; check its RBAC and the API server")


def make_app(
    state: FleetState,
    *,
    auth: Authenticator | None = None,
    trace_url_template: str = "",
    explainer: Explainer | None = None,
    waterfall: Waterfall | None = None,
    ping_s: float = 15.0,
) -> web.Application:
    api = Api(state, auth or Authenticator(), trace_url_template, explainer, waterfall, ping_s)
    app = web.Application(middlewares=[json_errors])
    app[STATE_KEY] = state
    app.router.add_get("/", api.index)
    app.router.add_get("/static/{name}", api.static)
    app.router.add_get("/healthz", api.healthz)
    app.router.add_get("/api/fleet", api.get_fleet)
    app.router.add_get("/api/stream", api.stream)
    app.router.add_get("/api/device/{node}/{device}", api.device)
    app.router.add_get("/api/telemetry/{node}", api.telemetry)
    app.router.add_get("/api/gpu-hours", api.gpu_hours)
    app.router.add_get("/api/claim/{namespace}/{name}", api.claim)
    app.router.add_get("/api/pod/{namespace}/{name}/explain", api.explain)
    return app


def parse_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` or `:PORT` -> (host, port); ValueError naming the form."""
    host, sep, port = listen.rpartition(":")
    number = decimal_int(port)
    if not sep or number is None or not 0 <= number <= 65535:
        raise ValueError(f"--listen {listen!r}: give HOST:PORT, e.g. 127.0.0.1:8765 or :8765")
    return host.strip("[]") or "0.0.0.0", number


@contextlib.asynccontextmanager
async def serve(app: web.Application, listen: str) -> Any:
    """Serve `app` on `listen` for the block; yields the bound (host, port) (port 0 picks a free one)."""
    host, port = parse_listen(listen)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    addresses = runner.addresses  # the bound sockets' names: the port the kernel picked for port 0
    bound = addresses[0][:2] if addresses else (host, port)
    try:
        yield bound[0], int(bound[1])
    finally:
        await runner.cleanup()
