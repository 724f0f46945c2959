"""The API server as one object: storage, registry, core, controllers (GC, CRDs), the request
chain (authentication, authorization Node then RBAC, admission NodeRestriction, policies, then validating
webhooks) and the HTTP listener on 127.0.0.1, plus the kubeconfigs that point clients at it (the admin's, and one per
ServiceAccount token)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
from pathlib import Path
from typing import Any

from aiohttp import web

from embedded.apiserver import (
    admission,
    authn,
    authz,
    nodeauthz,
    nodegraph,
    noderestriction,
    rbac,
    tls,
    webhooks,
)
from embedded.apiserver.app import build_app
from embedded.apiserver.core import Core, now
from embedded.apiserver.crds import CrdController
from embedded.apiserver.gc import GarbageCollector
from embedded.apiserver.requestcount import RequestCounter
from embedded.apiserver.resources import Registry, Resource
from embedded.apiserver.serviceaccounts import ServiceAccountsController
from embedded.apiserver.storage import Store
from embedded.apiserver.watch import WatchHub

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
ADMIN = authn.UserInfo("kubernetes-admin", "", (authn.MASTERS, authn.AUTHENTICATED))


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
        token_file: Path | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        self.pod_log_dir: Path | None = None  # the kubelets' container logs (pods/{name}/log)
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
        self.service_accounts = ServiceAccountsController(self.core)
        self.hub = WatchHub(self.store, bookmark_interval)
        self.requests = RequestCounter()  # served at /metrics
        # `token` is the admin's (system:masters: RBAC does not apply); the token file adds identities.
        # No token at all (plain HTTP without one) leaves the server open, as before.
        static = authn.parse_token_file(token_file.read_text(), str(token_file)) if token_file else {}
        if self.token:
            static[self.token] = ADMIN
        # what it presents to kubelets (pods/exec and kin), which they check with a TokenReview
        self.kubelet_client_token = secrets.token_urlsafe(32)
        if static:  # an open server (no tokens at all) stays open
            static[self.kubelet_client_token] = authn.UserInfo(authn.KUBELET_CLIENT, "", (authn.AUTHENTICATED,))
        self.authenticator = authn.Authenticator(self.store, static, authn.Authenticator.signing_key_for(data_dir))
        # --authorization-mode=Node,RBAC and --enable-admission-plugins=NodeRestriction, as a real cluster runs
        self.rbac = rbac.RbacAuthorizer(self.store)
        self.authorizer = authz.Chain(nodeauthz.NodeAuthorizer(nodegraph.NodeGraph(self.store)), self.rbac)
        self.node_restriction = noderestriction.NodeRestriction(self.store)
        self.policies = admission.PolicyAdmission(self.store)
        self.webhooks = webhooks.WebhookAdmission(self.store)  # called by the HTTP layer (http.py `_admitted`)
        self.core.admit = self._admit
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        self._bootstrap()
        self.service_accounts.start()
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
            self.port = int(self._runner.addresses[0][1])  # the port the kernel picked
        self.gc.start()

    async def stop(self) -> None:
        self.hub.closing.set()
        await self.gc.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.webhooks.close()
        await self.store.close()

    def _bootstrap(self) -> None:
        ns_res = self.registry.by_key("", "namespaces")
        assert ns_res is not None
        for name in DEFAULT_NAMESPACES:
            if self.store.get(ns_res.key, ("", name)) is None:
                self.core.create(ns_res, "v1", "", {"metadata": {"name": name}})
        for plural, objects in (
            ("clusterroles", rbac.bootstrap_cluster_roles()),
            ("clusterrolebindings", rbac.bootstrap_cluster_role_bindings()),
        ):
            res = self.registry.by_key(rbac.RBAC, plural)
            assert res is not None
            for obj in objects:
                if self.store.get(res.key, ("", obj["metadata"]["name"])) is None:
                    self.core.create(res, "v1", "", obj)

    def _admit(
        self,
        operation: str,
        res: Resource,
        version: str,
        subresource: str,
        namespace: str,
        name: str,
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
    ) -> None:
        if obj is not None:
            admission.check_size(res, name, obj)
        user = authn.current_user.get()
        if user is not None:  # the server's own writes (GC, finalizers) are not admitted
            self.node_restriction.admit(user, operation, res, subresource, namespace, name, obj, old)
            self.policies.admit(user, operation, res, version, subresource, namespace, name, obj, old)

    def bind_pod(self, res: Resource, pod: dict[str, Any], node: str) -> None:
        """The pods/binding subresource: set spec.nodeName and the PodScheduled condition."""
        md = pod.get("metadata") or {}
        status = dict(pod.get("status") or {})
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
        conditions.append(
            {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now()}
        )
        status["conditions"] = conditions
        updated = {**pod, "spec": {**(pod.get("spec") or {}), "nodeName": node}, "status": status}
        self.store.put(res.key, (md.get("namespace", ""), md["name"]), updated)

    def kubeconfig(self, namespace: str = "default", token: str | None = None) -> dict[str, Any]:
        """A kubeconfig for the admin, or for whoever holds `token`."""
        cluster: dict[str, Any] = {"server": self.url}
        if self.tls:
            cluster["certificate-authority-data"] = base64.b64encode(self.ca_pem).decode()
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "gpu-dra", "cluster": cluster}],
            "users": [{"name": "gpu-dra", "user": {"token": self.token if token is None else token}}],
            "contexts": [
                {"name": "gpu-dra", "context": {"cluster": "gpu-dra", "user": "gpu-dra", "namespace": namespace}}
            ],
            "current-context": "gpu-dra",
            "preferences": {},
        }

    def write_kubeconfig(self, path: Path, token: str | None = None) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # a credential: never readable by others
        with os.fdopen(fd, "w") as f:
            # JSON (which is YAML: kubectl reads it): our clients read it without PyYAML (shared.kube.kubeconfig)
            f.write(json.dumps(self.kubeconfig(token=token), indent=2) + "\n")
        tmp.replace(path)
        return path
