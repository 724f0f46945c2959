"""The API server as one object: storage, registry, core, controllers (GC, CRDs) and the HTTP
listener on 127.0.0.1, plus the kubeconfig that points clients at it."""

from __future__ import annotations

import asyncio
import base64
import secrets
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from embedded.apiserver import tls
from embedded.apiserver.core import Core, now
from embedded.apiserver.crds import CrdController
from embedded.apiserver.gc import GarbageCollector
from embedded.apiserver.http import build_app
from embedded.apiserver.resources import Registry, Resource
from embedded.apiserver.storage import Store
from embedded.apiserver.watch import WatchHub

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


class ApiServer:
    def __init__(
        self,
        data_dir: Path | None = None,
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        history_size: int = 20000,
        bookmark_interval: float = 60.0,
        tls: bool = True,
    ) -> None:
        self.host = host
        self.tls = tls
        self.data_dir = data_dir
        self.ca_pem = b""
        self.port = port
        self.token = token if token is not None else secrets.token_urlsafe(24)
        self.store = Store(data_dir, history_size=history_size)
        self.registry = Registry()
        self.core = Core(self.store, self.registry)
        self.crds = CrdController(self.core)
        self.crds.load_existing()
        self.gc = GarbageCollector(self.core)
        self.hub = WatchHub(self.store, bookmark_interval)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        self._bootstrap()
        app = build_app(self)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        ssl_context = None
        if self.tls:
            cert, key = await asyncio.to_thread(tls.ensure_pair, self.data_dir)
            self.ca_pem = cert.read_bytes()
            ssl_context = tls.server_context(cert, key)
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=ssl_context)
        await site.start()
        if self.port == 0:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.gc.start()

    async def stop(self) -> None:
        self.hub.closing.set()
        await self.gc.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.store.close()

    def _bootstrap(self) -> None:
        ns_res = self.registry.by_key("", "namespaces")
        assert ns_res is not None
        for name in DEFAULT_NAMESPACES:
            if self.store.get(ns_res.key, ("", name)) is None:
                self.core.create(ns_res, "v1", "", {"metadata": {"name": name}})

    def bind_pod(self, res: Resource, pod: dict[str, Any], node: str) -> None:
        """The pods/binding subresource: set spec.nodeName and the PodScheduled condition."""
        md = pod.get("metadata") or {}
        status = dict(pod.get("status") or {})
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
        conditions.append({"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                           "lastTransitionTime": now()})
        status["conditions"] = conditions
        updated = {**pod, "spec": {**(pod.get("spec") or {}), "nodeName": node}, "status": status}
        self.store.put(res.key, (md.get("namespace", ""), md["name"]), updated)

    def kubeconfig(self, namespace: str = "default") -> dict[str, Any]:
        cluster: dict[str, Any] = {"server": self.url}
        if self.tls:
            cluster["certificate-authority-data"] = base64.b64encode(self.ca_pem).decode()
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "gpu-dra", "cluster": cluster}],
            "users": [{"name": "gpu-dra", "user": {"token": self.token}}],
            "contexts": [{"name": "gpu-dra", "context": {"cluster": "gpu-dra", "user": "gpu-dra",
                                                         "namespace": namespace}}],
            "current-context": "gpu-dra",
            "preferences": {},
        }

    def write_kubeconfig(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(yaml.safe_dump(self.kubeconfig(), sort_keys=False))
        tmp.chmod(0o600)
        tmp.replace(path)
        return path
