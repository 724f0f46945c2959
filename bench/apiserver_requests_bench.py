"""Embedded API server benchmark: the cost of single-object requests (GET, status PATCH, PUT of a ResourceClaim).

The server runs as `gpu-dra apiserver` in its own process (as bench/apiserver_bench.py starts it), loaded
with the local cluster's RBAC and admission policies (deploy/ plus the embedded components'); this
process is the client over real HTTPS, one persistent aiohttp session per identity, one request at a
time. Phases: N GETs of one ResourceClaim, N merge-patches of its status and N PUTs of it, as a
ServiceAccount (a signed token, RBAC through ClusterRoleBindings: the cluster's services), plus N GETs as
the admin (system:masters: no RBAC). One watch (--watchers) on the claims stays open throughout, so a
write's cost includes delivering its event. Figures per phase: client latency p50/p99 and the server's CPU per request
(its threads' run time from /proc/<pid>/task/*/schedstat, over blocks of --block requests; the median block).

With --compare-repo, a server from another checkout (e.g. the commit before a change) runs the same
phases too, interleaved block by block, so all see the same machine noise (repeatable: NAME=DIR). Writes
bench/results/apiserver_requests.json.

    .venv/bin/python bench/apiserver_requests_bench.py [--requests 2000] [--block 200] [--compare-repo [NAME=]DIR ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedded.cluster import identities  # noqa: E402  (the cluster's RBAC, as `gpu-dra up` installs it)

NS = "bench"
CLAIMS = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"
CLAIM = f"{CLAIMS}/claim-0"
SA = "bench-client"
TICKS = os.sysconf("SC_CLK_TCK")
PATHS = {  # kind -> collection path (namespaced ones take the object's namespace)
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Namespace": "/api/v1/namespaces",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "ValidatingAdmissionPolicy": "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
}


@dataclass
class Server:
    name: str
    repo: Path
    proc: asyncio.subprocess.Process | None = None
    url: str = ""
    admin: aiohttp.ClientSession | None = None
    client: aiohttp.ClientSession | None = None
    latencies: dict[str, list[float]] = field(default_factory=dict)
    cpu_per_request: dict[str, list[float]] = field(default_factory=dict)
    watched: int = 0

    def cpu_s(self) -> float:
        """The server's CPU time so far: the run time of all its threads from schedstat (nanoseconds;
        /proc/<pid>/stat's utime+stime count 10 ms ticks, too coarse for blocks of sub-ms requests)."""
        assert self.proc is not None
        total = 0
        try:
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                total += int((task / "schedstat").read_text().split()[0])
            return total / 1e9
        except (FileNotFoundError, ValueError):  # a kernel without schedstat: the ticks
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def session(token: str, connections: int = 4) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=False, limit=connections),
        headers={"Authorization": f"Bearer {token}"},
        timeout=aiohttp.ClientTimeout(total=60),
    )


async def call(http: aiohttp.ClientSession, method: str, url: str, expect: int, **kw: Any) -> Any:
    async with http.request(method, url, **kw) as resp:
        if resp.status != expect:
            raise SystemExit(f"{method} {url}: {resp.status} {await resp.text()}")
        return await resp.json()


@contextlib.asynccontextmanager
async def running(server: Server, tmp: Path, watchers: int) -> AsyncIterator[Server]:
    kubeconfig = tmp / f"{server.name}.kubeconfig"
    env = {**os.environ, "PYTHONPATH": str(server.repo)}
    server.proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        "apiserver",
        "--port",
        "0",
        "--kubeconfig",
        str(kubeconfig),
        "--log-level",
        "warning",
        stdout=asyncio.subprocess.PIPE,
        cwd=server.repo,
        env=env,
    )
    try:
        assert server.proc.stdout is not None
        line = (await asyncio.wait_for(server.proc.stdout.readline(), 60)).decode()
        if "listening on" not in line:
            raise SystemExit(f"{server.name}: apiserver did not start: {line!r}")
        config = yaml.safe_load(kubeconfig.read_text())
        server.url = config["clusters"][0]["cluster"]["server"]
        async with session(config["users"][0]["user"]["token"], 4 + watchers) as admin:
            server.admin = admin
            token = await setup(server)
            async with session(token) as client:
                server.client = client
                watches = [asyncio.create_task(watch_claims(server)) for _ in range(watchers)]
                try:
                    yield server
                finally:
                    for watch in watches:
                        watch.cancel()
                    await asyncio.gather(*watches, return_exceptions=True)
    finally:
        server.proc.terminate()
        await server.proc.wait()


async def setup(server: Server) -> str:
    """The cluster's RBAC, a namespace, the client's ServiceAccount and role, one allocated claim;
    returns the ServiceAccount's token."""
    http, url = server.admin, server.url
    assert http is not None
    await call(http, "POST", url + PATHS["Namespace"], 201, json={"metadata": {"name": "gpu-dra"}})
    await call(http, "POST", url + PATHS["Namespace"], 201, json={"metadata": {"name": NS}})
    for doc in identities.deploy_objects() + identities.embedded_rbac():
        path = PATHS[doc["kind"]].format(ns=doc["metadata"].get("namespace", ""))
        await call(http, "POST", url + path, 201, json=doc)
    await call(http, "POST", url + PATHS["ServiceAccount"].format(ns=NS), 201, json={"metadata": {"name": SA}})
    role = {
        "metadata": {"name": "bench-claims"},
        "rules": [
            {
                "apiGroups": ["resource.k8s.io"],
                "resources": ["resourceclaims", "resourceclaims/status"],
                "verbs": ["get", "list", "watch", "update", "patch"],
            }
        ],
    }
    await call(http, "POST", url + PATHS["ClusterRole"], 201, json=role)
    await call(
        http,
        "POST",
        url + PATHS["ClusterRoleBinding"],
        201,
        json={
            "metadata": {"name": "bench-claims"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "bench-claims"},
            "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": NS}],
        },
    )
    issued = await call(
        http,
        "POST",
        url + PATHS["ServiceAccount"].format(ns=NS) + f"/{SA}/token",
        201,
        json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 86400}},
    )
    created = await call(
        http,
        "POST",
        url + CLAIMS,
        201,
        json={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "claim-0"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        },
    )
    status = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-0", "device": "gpu-0"}],
                "config": [],
            }
        },
        "reservedFor": [{"resource": "pods", "name": "pod-0", "uid": "uid-0"}],
    }
    await call(http, "PUT", url + CLAIM + "/status", 200, json={**created, "status": status})
    return str(issued["status"]["token"])


async def watch_claims(server: Server) -> None:
    """An informer's watch on the claims: each write's event is delivered (and counted) here."""
    assert server.admin is not None
    params = {"watch": "true", "allowWatchBookmarks": "true"}
    async with server.admin.get(
        server.url + CLAIMS,
        params=params,  # one connection per watch
        timeout=aiohttp.ClientTimeout(total=None),
    ) as resp:
        async for _ in resp.content:
            server.watched += 1


def get_request(identity: str) -> Callable[[Server, int], Awaitable[None]]:
    async def get(server: Server, i: int) -> None:
        http = server.client if identity == "sa" else server.admin
        assert http is not None
        async with http.get(server.url + CLAIM) as resp:
            await resp.read()
            assert resp.status == 200, resp.status

    return get


async def patch_status(server: Server, i: int) -> None:
    assert server.client is not None
    body = {"status": {"reservedFor": [{"resource": "pods", "name": f"pod-{i}", "uid": f"uid-{i}"}]}}
    async with server.client.patch(
        server.url + CLAIM + "/status", json=body, headers={"Content-Type": "application/merge-patch+json"}
    ) as resp:
        await resp.read()
        assert resp.status == 200, (resp.status, await resp.text())


async def put(server: Server, i: int, current: dict[str, dict[str, Any]] = {}) -> None:  # noqa: B006 - per-server cache
    """An update as a controller writes one: the object it holds with a label changed."""
    assert server.client is not None
    obj = current.get(server.name)
    if obj is None:
        obj = await call(server.client, "GET", server.url + CLAIM, 200)
    md = {**obj["metadata"], "labels": {"bench-round": str(i)}}
    async with server.client.put(server.url + CLAIM, json={**obj, "metadata": md}) as resp:
        body = await resp.json()
        assert resp.status == 200, (resp.status, body)
    current[server.name] = body


PHASES: dict[str, Callable[[Server, int], Awaitable[None]]] = {
    "get": get_request("sa"),
    "get_admin": get_request("admin"),
    "patch_status": patch_status,
    "put": put,
}


async def phase(servers: list[Server], name: str, requests: int, block: int) -> None:
    work = PHASES[name]
    for s in servers:  # warm-up
        for i in range(20):
            await work(s, i)
    n = 0
    while n < requests:
        turn = n // block % len(servers)  # each server takes each place in the order in turn
        for s in servers[turn:] + servers[:turn]:
            lat = s.latencies.setdefault(name, [])
            cpu0 = s.cpu_s()
            for i in range(n, n + block):
                t0 = time.perf_counter()
                await work(s, i)
                lat.append(time.perf_counter() - t0)
            s.cpu_per_request.setdefault(name, []).append((s.cpu_s() - cpu0) / block)
        n += block


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def figures(server: Server) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, lat in server.latencies.items():
        cpu = server.cpu_per_request[name]
        out[name] = {
            "requests": len(lat),
            "p50_ms": round(pct(lat, 0.5) * 1000, 3),
            "p99_ms": round(pct(lat, 0.99) * 1000, 3),
            "server_cpu_ms_per_request": round(statistics.median(cpu) * 1000, 3),
            "server_cpu_ms_per_request_blocks": [round(c * 1000, 3) for c in cpu],
        }
    out["watch_events_delivered"] = server.watched
    return out


def repo_spec(text: str) -> tuple[str, Path]:
    name, _, repo = text.rpartition("=")
    return name, Path(repo).resolve()


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per phase (per server)")
    ap.add_argument("--block", type=int, default=200, help="requests per CPU sample; servers alternate per block")
    ap.add_argument(
        "--watchers", type=int, default=1, help="watches open on the claims (each write's event goes to all)"
    )
    ap.add_argument("--phases", default=",".join(PHASES), help="comma-separated: " + ", ".join(PHASES))
    ap.add_argument(
        "--compare-repo",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        type=repo_spec,
        help="another checkout whose server runs too, as NAME (default `compare`); repeatable",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "apiserver_requests.json"))
    args = ap.parse_args(argv)
    servers = [Server("main", ROOT)]
    for i, (name, repo) in enumerate(args.compare_repo):
        servers.append(Server(name or ("compare" if i == 0 else f"compare-{i + 1}"), repo))
    with tempfile.TemporaryDirectory() as tmp:
        async with contextlib.AsyncExitStack() as stack:
            for s in servers:
                await stack.enter_async_context(running(s, Path(tmp), args.watchers))
            for name in args.phases.split(","):
                await phase(servers, name, args.requests, args.block)
            await asyncio.sleep(0.2)  # the last events reach the watch
    result: dict[str, Any] = {
        "benchmark": "apiserver_requests",
        "what": "one ResourceClaim over HTTPS, sequential requests on one persistent session; `get`, "
        "`patch_status` (merge patch) and `put` as a ServiceAccount with RBAC through ClusterRoleBindings "
        "(the cluster's RBAC loaded), `get_admin` as system:masters; --watchers watches on the claims open; "
        "server CPU from /proc/<pid>/task/*/schedstat per block of requests (median block)",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "block": args.block,
        "watchers": args.watchers,
    }
    for s in servers:
        result[s.name] = figures(s)
    out = Path(args.out)
    await asyncio.to_thread(out.parent.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(out.write_text, json.dumps(result, indent=2) + "\n")
    for name in args.phases.split(","):
        row = "  ".join(
            f"{s.name}: p50 {result[s.name][name]['p50_ms']:.2f} ms p99 {result[s.name][name]['p99_ms']:.2f} ms "
            f"cpu {result[s.name][name]['server_cpu_ms_per_request']:.3f} ms/req"
            for s in servers
        )
        print(f"{name:13s} {row}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    asyncio.run(main())
