"""The pods/exec subresource (and its kin): the API server's side of `kubectl exec`, a WebSocket proxied to the
kubelet of the pod's node, as kube-apiserver proxies it.

Owns the checks the API server makes before it dials a kubelet (the container exists, the pod is bound and not
finished, at least one stream is asked for), the kubelet's URL (the Node's InternalIP and
`status.daemonEndpoints.kubeletEndpoint.Port`, `/exec/<namespace>/<pod>/<container>` with the options as
`1`s), the kubelet client's credential (a token of its own user, `kube-apiserver-kubelet-client`, which the
kubelet checks with a TokenReview and a `nodes/proxy` SubjectAccessReview), and the relay of messages both ways.
The client's subprotocols (`v5.channel.k8s.io`, `v4.channel.k8s.io`) go to the kubelet and the one it picks
comes back; a client that asks for SPDY (kubectl older than 1.30, or its fallback) is told to use WebSockets.
RBAC asks `create` on `pods/exec` whatever the method (a WebSocket opens with GET), as upstream 1.35 does.
`pods/portforward` is relayed the same way (subprotocol `SPDY/3.1+portforward.k8s.io`: kubectl 1.31+ tunnels
SPDY in binary messages; the kubelet emulator reads the frames), `create` on `pods/portforward` asked for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

from embedded.apiserver import errors
from shared.logs import get_logger

log = get_logger(__name__)
SUBPROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
PORT_FORWARD_PROTOCOL = "SPDY/3.1+portforward.k8s.io"  # kubectl 1.31+: SPDY tunneled over the WebSocket
_TRUE = ("1", "true", "True", "TRUE", "t", "T")
_FINISHED = ("Succeeded", "Failed")


def _container(pod: dict[str, Any], wanted: str) -> str:
    spec = pod.get("spec") or {}
    name = pod["metadata"]["name"]
    names = [c["name"] for key in ("containers", "initContainers", "ephemeralContainers") for c in spec.get(key) or []]
    if not wanted:
        mains = [c["name"] for c in spec.get("containers") or []]
        if len(mains) == 1:
            return str(mains[0])
        raise errors.bad_request(
            f"a container name must be specified for pod {name}, choose one of: [{' '.join(mains)}]"
        )
    if wanted not in names:
        raise errors.bad_request(f"container {wanted} is not valid for pod {name}")
    return wanted


def kubelet_query(query: Any, subresource: str) -> list[tuple[str, str]]:
    """The options as the kubelet reads them: commands in order, flags as `1`."""
    out = [("command", c) for c in query.getall("command", [])] if subresource == "exec" else []
    for flag in ("stdin", "stdout", "stderr", "tty"):
        if query.get(flag, "") in _TRUE:
            out.append((flag, "1"))
    return out


def _kubelet_base(node: dict[str, Any]) -> str:
    status = node.get("status") or {}
    addresses = {a.get("type"): a.get("address") for a in status.get("addresses") or []}
    host = addresses.get("InternalIP") or addresses.get("Hostname") or "127.0.0.1"
    port = ((status.get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port") or 10250
    return f"http://{host}:{port}"


async def _relay(src: Any, dst: Any) -> None:
    async for msg in src:
        if msg.type == WSMsgType.BINARY:
            await dst.send_bytes(msg.data)
        elif msg.type == WSMsgType.TEXT:
            await dst.send_str(msg.data)
        else:
            break


def handler(server: Any, subresource: str) -> Any:
    """The handler of /api/v1/namespaces/{namespace}/pods/{name}/<subresource> (exec, attach)."""

    async def stream(request: web.Request) -> web.StreamResponse:
        ns, name = request.match_info["namespace"], request.match_info["name"]
        pod = server.core.get(server.registry.get("", "v1", "pods"), ns, name)
        q = request.query
        if request.headers.get("Upgrade", "").lower().startswith("spdy"):
            raise errors.bad_request(
                "this server streams over WebSockets (v5.channel.k8s.io) only: use kubectl 1.30 or newer"
            )
        if not any(q.get(f, "") in _TRUE for f in ("stdin", "stdout", "stderr")):
            raise errors.bad_request("you must specify at least one of stdin, stdout, stderr")
        if subresource == "exec" and not q.getall("command", []):
            raise errors.bad_request("you must specify at least 1 command")
        container = _container(pod, q.get("container", ""))
        phase = (pod.get("status") or {}).get("phase", "")
        if phase in _FINISHED:
            raise errors.bad_request(
                f"cannot {subresource} into a container in a completed pod; current phase is {phase}"
            )
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not node_name:
            raise errors.bad_request(f"pod {name} does not have a host assigned")
        node = server.core.get(server.registry.get("", "v1", "nodes"), "", node_name)
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        protocols = [p for p in offered if p in SUBPROTOCOLS]
        if not protocols:
            raise errors.bad_request(f"a WebSocket upgrade with subprotocol {' or '.join(SUBPROTOCOLS)} is required")
        url = f"{_kubelet_base(node)}/{subresource}/{ns}/{name}/{container}"
        return await _proxy(server, request, url, kubelet_query(q, subresource), protocols)

    return stream


def port_forward_handler(server: Any) -> Any:
    """The handler of /api/v1/namespaces/{namespace}/pods/{name}/portforward: the WebSocket that tunnels SPDY,
    relayed to the kubelet's `/portForward/<namespace>/<pod>` (`ports` passed on, as upstream's location)."""

    async def stream(request: web.Request) -> web.StreamResponse:
        ns, name = request.match_info["namespace"], request.match_info["name"]
        pod = server.core.get(server.registry.get("", "v1", "pods"), ns, name)
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not node_name:
            raise errors.bad_request(f"pod {name} does not have a host assigned")
        if request.headers.get("Upgrade", "").lower().startswith("spdy"):
            raise errors.bad_request(
                f"this server tunnels port-forward over WebSockets ({PORT_FORWARD_PROTOCOL}) only: use kubectl "
                "1.31 or newer, without KUBECTL_PORT_FORWARD_WEBSOCKETS=false"
            )
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        if PORT_FORWARD_PROTOCOL not in offered:
            raise errors.bad_request(f"a WebSocket upgrade with subprotocol {PORT_FORWARD_PROTOCOL} is required")
        node = server.core.get(server.registry.get("", "v1", "nodes"), "", node_name)
        url = f"{_kubelet_base(node)}/portForward/{ns}/{name}"
        params = [("ports", p) for p in request.query.getall("ports", [])]
        return await _proxy(server, request, url, params, [PORT_FORWARD_PROTOCOL])

    return stream


async def _proxy(
    server: Any, request: web.Request, url: str, params: list[tuple[str, str]], protocols: list[str]
) -> web.StreamResponse:
    """Dial the kubelet's WebSocket at `url` with the API server's kubelet client credential, then accept the
    client's in the subprotocol the kubelet chose and relay messages both ways until either side closes."""
    headers = {"Authorization": f"Bearer {server.kubelet_client_token}"}
    async with aiohttp.ClientSession() as session:
        try:
            upstream = await session.ws_connect(
                url, params=params, protocols=protocols, headers=headers, autoping=True, max_msg_size=0
            )
        except aiohttp.WSServerHandshakeError as exc:
            raise errors.ApiError(
                exc.status if exc.status >= 400 else 500, "InternalError", f"error dialing backend: {exc.message}"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise errors.ApiError(500, "InternalError", f"error dialing backend: {exc}") from None
        async with upstream:
            ws = web.WebSocketResponse(protocols=[upstream.protocol] if upstream.protocol else (), max_msg_size=0)
            await ws.prepare(request)
            relays = [asyncio.create_task(_relay(ws, upstream)), asyncio.create_task(_relay(upstream, ws))]
            await asyncio.wait(relays, return_when=asyncio.FIRST_COMPLETED)
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)
            with contextlib.suppress(ConnectionError):
                await ws.close()
    return ws
