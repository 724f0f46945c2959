"""A stand-in for the dashboard server that speaks the page's HTTP contract from fixture Fleet JSON.

It serves the packaged static files and a Fleet the test controls: `push()` changes node rows and sends
the delta to every open stream, so the page logic is tested without a cluster (and the 1,000-node
screenshot without a 1,000-node cluster).
"""

from __future__ import annotations

import asyncio
import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

STATIC = Path(__file__).resolve().parents[2] / "services" / "dashboard" / "static"
FIXTURES = Path(__file__).resolve().parent / "fixtures"

GI = 2**30


def load_fleet(name: str = "fleet.json") -> dict[str, Any]:
    return dict(json.loads((FIXTURES / name).read_text()))


def synthetic_fleet(nodes: int, gpus: int) -> dict[str, Any]:
    """`nodes` x `gpus` H100s in cliques of 18 nodes; every 3rd GPU claimed, every 97th tainted."""
    rows = []
    for n in range(nodes):
        devices = []
        for g in range(gpus):
            i = n * gpus + g
            allocs = []
            state = "free"
            if i % 97 == 5:
                state = "tainted"
            elif i % 3 == 0:
                state = "claimed"
                allocs = [
                    {
                        "namespace": f"team-{i % 5}",
                        "claim": f"job-{i}",
                        "claimUid": f"uid-{i}",
                        "pods": [f"team-{i % 5}/job-{i}-0"],
                        "since": "2026-12-04T12:00:00Z",
                        "sharing": {"mode": "exclusive", "interval": "", "threadPercentage": None, "pinnedMemory": ""},
                    }
                ]
            devices.append(
                {
                    "name": f"gpu-{g}",
                    "uuid": f"GPU-{i:08d}",
                    "product": "NVIDIA H100 80GB HBM3",
                    "memoryBytes": 80 * GI,
                    "type": "gpu",
                    "parent": "",
                    "mig": None,
                    "migSlots": 0,
                    "taints": [
                        {
                            "key": "gpu.nvidia.com/xid",
                            "value": "48",
                            "effect": "NoSchedule",
                            "timeAdded": "2026-12-04T12:00:00Z",
                        }
                    ]
                    if state == "tainted"
                    else [],
                    "xid": 48 if state == "tainted" else None,
                    "state": state,
                    "allocations": allocs,
                }
            )
        rows.append(
            {
                "name": f"node-{n:04d}",
                "pool": f"node-{n:04d}",
                "clique": f"c{n // 18}",
                "domains": [],
                "ready": True,
                "devices": devices,
            }
        )
    groups = [
        {"name": f"clique c{c}", "nodes": [r["name"] for r in rows if r["clique"] == f"c{c}"]}
        for c in range((nodes + 17) // 18)
    ]
    return {
        "version": 1,
        "generatedAt": "2026-12-04T12:00:00Z",
        "groups": groups,
        "nodes": rows,
        "counters": {},
        "traceUrlTemplate": "",
        "namespaces": [f"team-{t}" for t in range(5)],
    }


def counters(nodes: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for node in nodes:
        for d in node["devices"]:
            by_state = out.setdefault(d["product"], {"free": 0, "claimed": 0, "tainted": 0})
            by_state[d["state"]] += 1
    return out


def for_tenant(node: dict[str, Any], namespace: str) -> dict[str, Any]:
    """The row as a viewer of `namespace` sees it: other tenants' allocations without names."""
    if not namespace:
        return node
    row = copy.deepcopy(node)
    for d in row["devices"]:
        for a in d["allocations"]:
            if a["namespace"] != namespace:
                a.update(namespace="", claim="", claimUid="", pods=[], otherTenant=True)
                if a.get("share"):
                    a["share"] = {**a["share"], "id": ""}
    return row


class FixtureFleet:
    def __init__(self, fleet: dict[str, Any], token: str = "") -> None:
        self.fleet = fleet
        self.token = token  # when set, /api/ asks for it (Authorization: Bearer, or ?token=)
        self.seen_tokens: list[tuple[str, str]] = []  # (path, how the token came: header | query)
        self.fleet["counters"] = counters(fleet["nodes"])
        self.streams: list[tuple[str, asyncio.Queue[str | None]]] = []

    def view(self, namespace: str) -> dict[str, Any]:
        return {
            **self.fleet,
            "pending": self.pending(namespace),
            "nodes": [for_tenant(n, namespace) for n in self.fleet["nodes"]],
        }

    def pending(self, namespace: str) -> list[dict[str, Any]]:
        return [p for p in self.fleet.get("pending") or [] if not namespace or p["namespace"] == namespace]

    def push_pending(self, pending: list[dict[str, Any]]) -> None:
        """Replace the waiting pods and send the delta (no rows) to every stream."""
        self.fleet["pending"] = pending
        self.fleet["version"] += 1
        for namespace, queue in self.streams:
            delta = {
                "version": self.fleet["version"],
                "nodes": [],
                "removed": [],
                "pending": self.pending(namespace),
                "counters": self.fleet["counters"],
                "groups": self.fleet["groups"],
            }
            queue.put_nowait(f"event: delta\ndata: {json.dumps(delta)}\n\n")

    def push_telemetry(self, nodes: dict[str, dict[str, list[Any]]], full: bool = False) -> None:
        """Send a `telemetry` event (node -> device -> [time, SM %, memory used, memory total, W, °C(, SM %
        points when full)], as the dashboard's server sends it) to every stream."""
        for _, queue in self.streams:
            queue.put_nowait(f"event: telemetry\ndata: {json.dumps({'full': full, 'nodes': nodes})}\n\n")

    def node(self, name: str) -> dict[str, Any]:
        return next(n for n in self.fleet["nodes"] if n["name"] == name)

    def close(self) -> None:
        """End every open stream (the server then stops without waiting on them)."""
        for _, queue in self.streams:
            queue.put_nowait(None)

    def push(self, changed: list[dict[str, Any]]) -> None:
        """Replace (or add) whole node rows and send the delta to every stream."""
        by_name = {n["name"]: i for i, n in enumerate(self.fleet["nodes"])}
        for row in changed:
            if row["name"] in by_name:
                self.fleet["nodes"][by_name[row["name"]]] = row
            else:
                self.fleet["nodes"].append(row)
        self.fleet["version"] += 1
        self.fleet["counters"] = counters(self.fleet["nodes"])
        for namespace, queue in self.streams:
            delta = {
                "version": self.fleet["version"],
                "nodes": [for_tenant(r, namespace) for r in changed],
                "removed": [],
                "counters": self.fleet["counters"],
                "groups": self.fleet["groups"],
            }
            queue.put_nowait(f"event: delta\ndata: {json.dumps(delta)}\n\n")


def make_fixture_app(state: FixtureFleet) -> web.Application:
    async def index(_: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")

    async def fleet(request: web.Request) -> web.Response:
        return web.json_response(state.view(request.query.get("namespace", "")))

    async def stream(request: web.Request) -> web.StreamResponse:
        namespace = request.query.get("namespace", "")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        entry = (namespace, queue)
        state.streams.append(entry)
        try:
            # retry: the browser reconnects 100 ms after a stream ends (its default is seconds)
            full = json.dumps({**state.view(namespace), "full": True})
            await resp.write(f"retry: 100\nevent: fleet\ndata: {full}\n\n".encode())
            while (item := await queue.get()) is not None:
                await resp.write(item.encode())
        finally:
            state.streams.remove(entry)
        return resp

    async def device(request: web.Request) -> web.Response:
        node = state.node(request.match_info["node"])
        dev = next(d for d in node["devices"] if d["name"] == request.match_info["device"])
        events = [{"time": "2026-12-04T14:10:00Z", "type": "prepared", "summary": "claim prepared"}]
        return web.json_response({"device": dev, "node": node["name"], "events": events})

    async def claim(request: web.Request) -> web.Response:
        ns, name = request.match_info["namespace"], request.match_info["name"]
        found = [
            (n["name"], d["name"], a)
            for n in state.fleet["nodes"]
            for d in n["devices"]
            for a in d["allocations"]
            if (a["namespace"], a["claim"]) == (ns, name)
        ]
        if not found:
            return web.json_response({"error": f"claim {ns}/{name} not found"}, status=404)
        trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        return web.json_response(
            {
                "claim": {
                    "namespace": ns,
                    "name": name,
                    "uid": found[0][2]["claimUid"],
                    "pods": found[0][2]["pods"],
                    "devices": [{"node": n, "device": d} for n, d, _ in found],
                },
                "traceId": trace,
                "traceUrl": state.fleet["traceUrlTemplate"].replace("{traceId}", trace),
                "waterfall": "allocate  |====      |\nprepare   |    ===== |",
            }
        )

    async def explain(request: web.Request) -> web.Response:
        pod = f"{request.match_info['namespace']}/{request.match_info['name']}"
        return web.json_response({"text": f"pod {pod}: fixture explain at {datetime.now(UTC).isoformat()}"})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    @web.middleware
    async def bearer(request: web.Request, handler: Any) -> web.StreamResponse:
        if not state.token or not request.path.startswith("/api/"):
            return await handler(request)
        header = request.headers.get("Authorization", "").removeprefix("Bearer ")
        given, how = (header, "header") if header else (request.query.get("token", ""), "query")
        if given != state.token:
            return web.json_response(
                {"error": "the token was refused; open the page with ?token=<your token>"}, status=401
            )
        state.seen_tokens.append((request.path, how))
        return await handler(request)

    app = web.Application(middlewares=[bearer])
    app.router.add_get("/", index)
    app.router.add_static("/static", STATIC)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/fleet", fleet)
    app.router.add_get("/api/stream", stream)
    app.router.add_get("/api/device/{node}/{device}", device)
    app.router.add_get("/api/claim/{namespace}/{name}", claim)
    app.router.add_get("/api/pod/{namespace}/{name}/explain", explain)
    return app


async def stop(state: FixtureFleet, runner: web.AppRunner) -> None:
    state.close()
    await runner.cleanup()


async def start(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve `app` on a free loopback port; returns the runner (to clean up) and the base URL."""
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"
