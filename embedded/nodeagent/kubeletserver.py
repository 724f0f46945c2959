"""The kubelet API's streaming endpoints, which the API server proxies `pods/exec` (and kin) to.

Owns the listener (127.0.0.1, a free port the Node's `status.daemonEndpoints.kubeletEndpoint.Port` names),
authentication and authorization of every request (kubeletauth.py: only a user the API server allows
`nodes/proxy` on this node gets through, which is the API server's kubelet client), and the routes upstream's
kubelet serves: `/exec/{namespace}/{pod}/{container}` (`command`, `stdin`, `stdout`, `stderr`, `tty` query
parameters) speaking the remote command protocol (remotecommand.py) to a process joined to the container's
sandbox (execproc.py); `/attach/{namespace}/{pod}/{container}` the same protocol on the container's own
streams (attach.py); `/portForward/{namespace}/{pod}` SPDY tunneled over a WebSocket (portforward.py), each
forwarded connection dialled inside the pod's sandbox (netnsdial.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

from embedded.nodeagent import execproc, netnsdial, portforward, remotecommand
from embedded.nodeagent.containers import PodWorker
from embedded.nodeagent.kubeletauth import KubeletAuth
from shared.kube.rest import ApiError
from shared.logs import get_logger

log = get_logger(__name__)
TRUE = ("1", "true", "True", "TRUE", "t", "T")


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "") in TRUE


class KubeletServer:
    def __init__(self, auth: KubeletAuth, workers: Callable[[], dict[str, PodWorker]]) -> None:
        self.auth = auth
        self.workers = workers  # pod uid -> its containers (the PodRunner's)
        self.port = 0
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authorize])
        for method in ("GET", "POST"):
            app.router.add_route(method, "/exec/{namespace}/{pod}/{container}", self.exec)
            app.router.add_route(method, "/exec/{namespace}/{pod}/{uid}/{container}", self.exec)
            app.router.add_route(method, "/attach/{namespace}/{pod}/{container}", self.attach)
            app.router.add_route(method, "/attach/{namespace}/{pod}/{uid}/{container}", self.attach)
            app.router.add_route(method, "/portForward/{namespace}/{pod}", self.port_forward)
            app.router.add_route(method, "/portForward/{namespace}/{pod}/{uid}", self.port_forward)
        return app

    async def start(self, host: str = "127.0.0.1") -> int:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        await web.SockSite(self._runner, sock).start()
        self.port = int(sock.getsockname()[1])
        log.info("kubelet API listening", port=self.port)
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            user = await self.auth.user(request.headers.get("Authorization", ""))
            if user is None:
                return web.Response(status=401, text="Unauthorized")
            if not await self.auth.allowed(user, request.method, "proxy"):
                return web.Response(
                    status=403,
                    text=f"Forbidden (user={user.get('username', '')}, "
                    f"verb={request.method.lower()}, resource=nodes, "
                    "subresource=proxy)",
                )
        except (ApiError, OSError) as exc:
            return web.Response(status=500, text=f"authorization failed: {exc}")
        response: web.StreamResponse = await handler(request)
        return response

    def _worker(self, namespace: str, pod: str, uid: str = "") -> PodWorker:
        for worker in self.workers().values():
            meta = worker.pod["metadata"]
            if meta["namespace"] == namespace and meta["name"] == pod and (not uid or meta["uid"] == uid):
                return worker
        raise web.HTTPNotFound(text=f"pod {namespace}/{pod} is not running on this node")

    async def exec(self, request: web.Request) -> web.StreamResponse:
        m = request.match_info
        worker = self._worker(m["namespace"], m["pod"], m.get("uid", ""))
        container = m["container"]
        argv = request.query.getall("command", [])
        if not argv:
            raise web.HTTPBadRequest(text="you must specify at least 1 command")
        pid = worker.running_pid(container)
        target = execproc.sandbox_init(pid) if pid is not None else None
        if target is None:
            raise web.HTTPNotFound(text=f'container "{container}" is not running')
        ws = await _upgrade(request)
        tty, stdin = _flag(request, "tty"), _flag(request, "stdin")
        try:
            proc = await execproc.ExecProcess.start(target, argv, worker.envs.get(container, {}), tty=tty, stdin=stdin)
        except OSError as exc:
            await remotecommand.finish(ws, remotecommand.failure(f"failed to exec in container: {exc}"))
            return ws
        log.info("exec started", pod=m["pod"], container=container, command=argv[0], tty=tty)
        try:
            code = await remotecommand.serve(
                ws, proc, stdin=stdin, stdout=_flag(request, "stdout"), stderr=_flag(request, "stderr"), tty=tty
            )
            log.info("exec ended", pod=m["pod"], container=container, exit_code=code)
        finally:
            await proc.kill()
            with contextlib.suppress(ConnectionError):
                await ws.close()
        return ws

    async def attach(self, request: web.Request) -> web.StreamResponse:
        m = request.match_info
        worker = self._worker(m["namespace"], m["pod"], m.get("uid", ""))
        session = worker.attach(m["container"])
        if session is None:
            raise web.HTTPNotFound(text=f'container "{m["container"]}" is not running')
        try:
            ws = await _upgrade(request)
            await remotecommand.serve(
                ws,
                session,
                stdin=_flag(request, "stdin"),
                stdout=_flag(request, "stdout"),
                stderr=_flag(request, "stderr"),
                tty=_flag(request, "tty"),
            )
        finally:
            session.close()
        with contextlib.suppress(ConnectionError):
            await ws.close()
        return ws

    async def port_forward(self, request: web.Request) -> web.StreamResponse:
        m = request.match_info
        worker = self._worker(m["namespace"], m["pod"], m.get("uid", ""))
        ws = web.WebSocketResponse(protocols=(portforward.WS_PROTOCOL,), max_msg_size=0)
        if ws.can_prepare(request).protocol != portforward.WS_PROTOCOL:
            raise web.HTTPBadRequest(text=f"a WebSocket upgrade with subprotocol {portforward.WS_PROTOCOL} is required")

        async def dial(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            pids = [worker.running_pid(name) for name in worker.specs]
            inits = [execproc.sandbox_init(pid) for pid in pids if pid is not None]
            running = [pid for pid in inits if pid is not None]
            if not running:
                raise netnsdial.DialError("no container of the pod is running")
            return await netnsdial.connect(await netnsdial.pick(running, port), port)

        meta = worker.pod["metadata"]
        forwarder = portforward.PortForwarder(dial, f"{meta['name']}_{meta['namespace']}", meta["uid"])
        await ws.prepare(request)
        log.info("port-forward session", pod=m["pod"])
        try:
            await portforward.serve(ws, forwarder)
        finally:
            with contextlib.suppress(ConnectionError):
                await ws.close()
        return ws


async def _upgrade(request: web.Request) -> web.WebSocketResponse:
    """The WebSocket of a remote command, in a channel protocol the client offers (400 otherwise)."""
    ws = web.WebSocketResponse(protocols=remotecommand.PROTOCOLS)
    ready = ws.can_prepare(request)
    if not ready.ok or ready.protocol is None:
        raise web.HTTPBadRequest(
            text=f"a WebSocket upgrade with subprotocol {' or '.join(remotecommand.PROTOCOLS)} is required"
        )
    await ws.prepare(request)
    return ws
