"""A lightweight API server for fleet benchmarks: serves Nodes and ResourceSlices, records every slice write.

Not the product's embedded API server (that one validates, admits, watches and stores every object
in full): this one keeps only what a publisher reads back (name, uid, resourceVersion, the content
hash, pool, device names), so that it is not the bottleneck at 65,000 nodes. Each publisher replica
talks to its own port: the port says which replica wrote, without any change to the publisher.

    python bench/recording_apiserver.py --nodes 10000 --ports 4

Prints `{"ports": [...], "control": port}` on one line once listening. Control endpoints (on
the control port): `GET /summary` (write counts, nodes written by more than one replica, identical
rewrites), `GET /wait?creates=N` (returns once N slices were created), `GET /count?node=X` and
`GET /wait?node=X&after=C` (returns, with the arrival time, once node X has more than C writes).
Semantics kept from the real server: 409 for a create of an existing name or a stale
resourceVersion, 404 for an update or delete of a missing name, paged LISTs, fieldSelector on
`spec.driver` and `spec.nodeName`, watches that stay open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
import uuid
from collections import defaultdict
from typing import Any

import msgspec
from aiohttp import web


class Meta(msgspec.Struct, omit_defaults=True):
    name: str
    uid: str = ""
    resourceVersion: str = ""  # noqa: N815 - wire name
    annotations: dict[str, str] = {}


class Pool(msgspec.Struct, omit_defaults=True):
    name: str = ""
    generation: int = 0
    resourceSliceCount: int = 0  # noqa: N815


class Device(msgspec.Struct):
    name: str


class Spec(msgspec.Struct, omit_defaults=True):
    driver: str = ""
    nodeName: str = ""  # noqa: N815
    pool: Pool = msgspec.field(default_factory=Pool)
    devices: list[Device] = []


class Slice(msgspec.Struct):
    """What the server keeps of a slice: what the publisher's SliceView reads back."""

    metadata: Meta
    spec: Spec = msgspec.field(default_factory=Spec)


_SLICE = msgspec.json.Decoder(Slice)
_ENC = msgspec.json.Encoder()
HASH = "publisher.gpu-dra.io/content-hash"


def status(code: int, reason: str, message: str) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    return web.Response(status=code, body=_ENC.encode(body), content_type="application/json")


class Recorder:
    """The slices, and every write: (replica port, verb, node, monotonic time)."""

    def __init__(self, nodes: int) -> None:
        self.node_names = [f"node-{i:05d}" for i in range(nodes)]
        self.node_uids = {n: str(uuid.uuid5(uuid.NAMESPACE_DNS, n)) for n in self.node_names}
        # the Nodes never change: built once, each LIST page a slice of it (building all 65,000 for each page of
        # 500 made every replica's Node LIST quadratic: most of a 65,000-node start before the first write)
        self.node_items = [
            {"metadata": {"name": n, "uid": self.node_uids[n], "resourceVersion": "1"}} for n in self.node_names
        ]
        self.slices: dict[str, Slice] = {}
        # node -> its slices' names: a LIST by spec.nodeName reads the node's, as an indexed cache does, not
        # every slice (2,560 taken-over nodes x 20,000 slices scanned made this server the takeover's bottleneck)
        self.by_node: dict[str, dict[str, None]] = defaultdict(dict)
        self.rv = 1
        self.writes: dict[str, int] = defaultdict(int)  # verb -> count
        self.by_replica: dict[int, int] = defaultdict(int)
        self.node_writers: dict[str, set[int]] = defaultdict(set)
        self.node_writes: dict[str, int] = defaultdict(int)
        self.same_hash_rewrites = 0  # an update that changed nothing (a wasted write)
        self.conflicts = 0
        self.first_write = 0.0
        self.last_write = 0.0
        self._changed = asyncio.Event()

    def record(self, port: int, verb: str, node: str) -> None:
        now = time.monotonic()
        self.first_write = self.first_write or now
        self.last_write = now
        self.writes[verb] += 1
        self.by_replica[port] += 1
        self.node_writers[node].add(port)
        self.node_writes[node] += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self, check: Any) -> None:
        while not check():
            await self._changed.wait()

    def summary(self) -> dict[str, Any]:
        return {
            "writes": dict(self.writes),
            "by_replica": {str(k): v for k, v in self.by_replica.items()},
            "slices": len(self.slices),
            "conflicts": self.conflicts,
            "nodes_written_by_several": sum(1 for w in self.node_writers.values() if len(w) > 1),
            "same_hash_rewrites": self.same_hash_rewrites,
            "first_write": self.first_write,
            "last_write": self.last_write,
        }


def build_app(rec: Recorder, port_of: dict[int, int]) -> web.Application:
    base = "/apis/resource.k8s.io/v1/resourceslices"

    def replica(request: web.Request) -> int:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        return port_of.get(sock[1] if sock else 0, 0)

    def json_response(doc: Any) -> web.Response:
        return web.Response(body=_ENC.encode(doc), content_type="application/json")

    async def group(_r: web.Request) -> web.Response:
        return json_response(
            {
                "kind": "APIGroup",
                "apiVersion": "v1",
                "name": "resource.k8s.io",
                "versions": [{"groupVersion": "resource.k8s.io/v1", "version": "v1"}],
                "preferredVersion": {"groupVersion": "resource.k8s.io/v1", "version": "v1"},
            }
        )

    async def version(_r: web.Request) -> web.Response:
        return json_response({"major": "1", "minor": "34", "gitVersion": "v1.34.0-recording"})

    async def hold_watch(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await asyncio.Event().wait()  # nothing ever changes; the client closes it
        return resp

    def page(request: web.Request, items: list[Any]) -> web.Response:
        limit = int(request.query.get("limit") or 0) or len(items) or 1
        start = int(request.query.get("continue") or 0)
        chunk = items[start : start + limit]
        cont = str(start + limit) if start + limit < len(items) else ""
        return json_response(
            {
                "kind": "List",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(rec.rv), "continue": cont},
                "items": chunk,
            }
        )

    async def nodes(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") == "true":
            return await hold_watch(request)
        return page(request, rec.node_items)

    async def list_slices(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") == "true":
            return await hold_watch(request)
        wanted = dict(part.split("=", 1) for part in request.query.get("fieldSelector", "").split(",") if part)
        driver, node = wanted.get("spec.driver"), wanted.get("spec.nodeName")
        candidates = rec.slices.values() if node is None else [rec.slices[name] for name in rec.by_node.get(node, ())]
        items = [
            s
            for s in candidates
            if (driver is None or s.spec.driver == driver) and (node is None or s.spec.nodeName == node)
        ]
        return page(request, items)

    def stored(new: Slice) -> web.Response:
        rec.rv += 1
        new.metadata.resourceVersion = str(rec.rv)
        rec.slices[new.metadata.name] = new
        rec.by_node[new.spec.nodeName][new.metadata.name] = None
        return web.Response(body=_ENC.encode(new), content_type="application/json")

    async def create(request: web.Request) -> web.Response:
        new = _SLICE.decode(await request.read())
        if new.metadata.name in rec.slices:
            rec.conflicts += 1
            return status(409, "AlreadyExists", f"resourceslices {new.metadata.name!r} already exists")
        new.metadata.uid = str(uuid.uuid4())
        rec.record(replica(request), "create", new.spec.nodeName)
        return stored(new)

    async def update(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        new = _SLICE.decode(await request.read())
        old = rec.slices.get(name)
        if old is None:
            return status(404, "NotFound", f"resourceslices {name!r} not found")
        if new.metadata.resourceVersion != old.metadata.resourceVersion:
            rec.conflicts += 1
            return status(409, "Conflict", f"resourceslices {name!r}: the object has been modified")
        if new.metadata.annotations.get(HASH) == old.metadata.annotations.get(HASH):
            rec.same_hash_rewrites += 1
        new.metadata.uid = old.metadata.uid
        rec.record(replica(request), "update", new.spec.nodeName)
        return stored(new)

    async def delete(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        old = rec.slices.pop(name, None)
        if old is None:
            return status(404, "NotFound", f"resourceslices {name!r} not found")
        rec.by_node[old.spec.nodeName].pop(name, None)
        rec.record(replica(request), "delete", old.spec.nodeName)
        return json_response({"kind": "Status", "status": "Success"})

    async def nodeconfigs(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") == "true":
            return await hold_watch(request)
        return page(request, [])

    async def event(_r: web.Request) -> web.Response:
        return json_response({"kind": "Event"})

    async def summary(_r: web.Request) -> web.Response:
        return json_response(rec.summary())

    async def wait(request: web.Request) -> web.Response:
        if "creates" in request.query:
            want = int(request.query["creates"])
            await rec.wait(lambda: rec.writes["create"] >= want)
        else:
            node, after = request.query["node"], int(request.query["after"])
            await rec.wait(lambda: rec.node_writes[node] > after)
        return json_response({"at": rec.last_write, **rec.summary()})

    async def count(request: web.Request) -> web.Response:
        return json_response({"count": rec.node_writes[request.query["node"]]})

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_get("/apis/resource.k8s.io", group)
    app.router.add_get("/version", version)
    app.router.add_get("/api/v1/nodes", nodes)
    app.router.add_get(base, list_slices)
    app.router.add_post(base, create)
    app.router.add_put(base + "/{name}", update)
    app.router.add_delete(base + "/{name}", delete)
    app.router.add_post("/api/v1/namespaces/{ns}/events", event)
    app.router.add_get("/apis/resource.nvidia.com/v1beta1/nodeconfigs", nodeconfigs)
    app.router.add_get("/summary", summary)
    app.router.add_get("/wait", wait)
    app.router.add_get("/count", count)
    return app


async def serve(nodes: int, ports: int) -> None:
    rec = Recorder(nodes)
    runner = web.AppRunner(build_app(rec, port_of := {}), access_log=None)
    await runner.setup()
    bound: list[int] = []
    for index in range(ports + 1):  # the last one: the bench's control port
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        port_of[port] = index
        bound.append(port)
    print(json.dumps({"ports": bound[:-1], "control": bound[-1]}), flush=True)  # the bench waits for this line
    await asyncio.Event().wait()


def kubeconfig(port: int) -> dict[str, Any]:
    """A kubeconfig (JSON) for one replica's port."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "rec",
        "clusters": [{"name": "rec", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "rec", "user": {"token": "bench"}}],
        "contexts": [{"name": "rec", "context": {"cluster": "rec", "user": "rec"}}],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--ports", type=int, default=1, help="one per publisher replica")
    args = parser.parse_args()
    asyncio.run(serve(args.nodes, args.ports))
