"""A whole local GPU cluster on one machine: NATS, the API server and every service as its own process.

Owns the layout of the data directory, the order things start in and what "ready" means for each
(observed effects, not timers: the API server answers, a node's inventory is in KV, its plugin
sockets exist and its Node is Ready, its ResourceSlices are published), and the teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, TypeVar

import msgspec
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.cluster import identities
from embedded.cluster.processes import ProcessFailed, Supervisor, gpu_dra
from shared.bus import Bus
from shared.config import CommonConfig, load_config_or_report
from shared.deviceclasses import device_classes
from shared.events import catalog
from shared.kubeclient import kube_api_client
from shared.logs import get_logger, setup_logging
from shared.natsserver import EmbeddedNats, free_port

log = get_logger(__name__)
GPU_DRIVER = "gpu.nvidia.com"
# the ComputeDomain controller assigns domains from allocated claims; agents count only those (docs/security.md)
ASSIGNED_DOMAINS_ONLY = {"GPU_DRA_REQUIRE_ASSIGNMENT": "true"}


C = TypeVar("C", bound="ClusterConfig")


class ClusterConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    nodes: Annotated[int, msgspec.Meta(ge=1, description="simulated GPU nodes")] = 2
    gpus: str = "h100x8"  # --simulate spec for every node, or SPEC;SPEC;... one per node (cycled)
    machine: str = ""  # YAML machine file for every node (instead of --gpus)
    kubeconfig: str = ""  # where to write the kubeconfig (default <data-dir>/kubeconfig)
    data_dir: str = ""  # all state; a temp dir removed on exit when not given
    node_prefix: str = "gpu-node-"
    dynamic_mig: bool = False  # publish MIG-capable GPUs as partitionable devices
    compute_domains: bool = True  # run a ComputeDomain agent (IMEX daemons) on every node
    start_timeout: float = 90.0

    def node_spec(self, index: int) -> str:
        """The --simulate spec of node `index`: `--gpus` may list one per node, separated by ';'."""
        specs = [s.strip() for s in self.gpus.split(";") if s.strip()]
        return specs[index % len(specs)] if specs else self.gpus


def node_ip(index: int) -> str:
    """A loopback address of a node's own, so that IMEX daemons of several nodes share one port."""
    return f"127.0.{90 + index // 200}.{1 + index % 200}"


class LocalCluster:
    """`async with LocalCluster(cfg, progress=print) as cluster:` a running cluster."""

    def __init__(self, cfg: ClusterConfig, progress: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.progress = progress or (lambda line: None)
        self._own_dir = not cfg.data_dir
        self.data_dir = Path(cfg.data_dir or tempfile.mkdtemp(prefix="gpu-dra-cluster-"))
        self.kubeconfig_path = Path(cfg.kubeconfig) if cfg.kubeconfig else self.data_dir / "kubeconfig"
        self.node_names = [f"{cfg.node_prefix}{i}" for i in range(cfg.nodes)]
        self.nats: EmbeddedNats | None = None
        self.nats_url = cfg.nats_url
        self.supervisor: Supervisor | None = None
        self.api: client.ApiClient | None = None
        self.bus: Bus | None = None
        self.identities_dir = self.data_dir / "identities"  # a kubeconfig per identity, and the token file
        self.kubeconfigs: dict[str, Path] = {}
        self.extra_env: dict[str, str] = {}
        # Unix socket paths are limited to 107 bytes, which a deep --data-dir easily exceeds, so the
        # kubelet dirs (sockets, checkpoints) live under a short runtime dir; <node>/var/lib/kubelet
        # in the data dir is a link to it, so the data dir still shows a node's whole tree.
        self.socket_root = Path(tempfile.mkdtemp(prefix="gdra-", dir="/tmp"))
        self.imex_port = free_port()  # every node's IMEX daemon listens on it, each on its node's address

    def node_dir(self, node: str) -> Path:
        return self.data_dir / "nodes" / node

    def node_paths(self, node: str) -> dict[str, Path]:
        root = self.node_dir(node)
        kubelet = self.socket_root / str(self.node_names.index(node))
        return {
            "root": root,
            "kubelet": kubelet,
            "registry": kubelet / "plugins_registry",
            "plugins": kubelet / "plugins",
            "cdi": root / "var/run/cdi",
        }

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> LocalCluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    def _env(self) -> dict[str, str]:
        # No process inherits the admin's kubeconfig: each gets its own identity's (`_kube`), or none.
        # POD_NAMESPACE as a pod in deploy/'s namespace has it (the controller's Lease lives there).
        return {"GPU_DRA_NATS_URL": self.nats_url, "GPU_DRA_LOG_FORMAT": "json", "KUBECONFIG": "",
                "POD_NAMESPACE": identities.NODE.namespace, **self.extra_env}

    def _kube(self, identity: str) -> tuple[list[str], dict[str, str]]:
        """The flags and environment that make a process `identity` (a kubeconfig file path, not a token)."""
        path = str(self.kubeconfigs[identity])
        return ["--kubeconfig", path], {"KUBECONFIG": path}

    async def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.nats_url:
            self.nats = EmbeddedNats(store_dir=self.data_dir / "nats")
            await self.nats.start()
            self.nats_url = self.nats.url
        self.progress(f"nats-server (JetStream)   {self.nats_url}")
        self.bus = await Bus.connect(self.nats_url, name="gpu-dra-up")
        await self.bus.provision()
        sup = self.supervisor = Supervisor(self.data_dir / "logs", self._env())
        port = free_port()
        kubelets = identities.kubelet_tokens(self.node_names)
        token_file = await asyncio.to_thread(identities.write_secret, self.identities_dir / "tokens.csv",
                                             identities.token_file_text(kubelets))
        # The admin's token is made by the server and written only into its kubeconfig (0600).
        await sup.start("apiserver", gpu_dra("apiserver", "--port", str(port), "--kubeconfig",
                                             str(self.kubeconfig_path), "--data-dir",
                                             str(self.data_dir / "apiserver"), "--token-auth-file", str(token_file)))
        await sup.wait_until("the API server", self._apiserver_ready, timeout=self.cfg.start_timeout)
        self.progress(f"API server                https://127.0.0.1:{port} (kubeconfig {self.kubeconfig_path})")
        await self._install_cluster_objects()
        await self._install_identities(kubelets)
        await self._start_cluster_services()
        await asyncio.gather(*(self._start_node(node) for node in self.node_names))
        await sup.wait_until("ResourceSlices for every node", self._slices_published, timeout=self.cfg.start_timeout)
        self.progress(f"ResourceSlices published  {len(self.node_names)} node(s)")

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.api is not None:
            await self.api.close()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.close()
        if self.nats is not None:
            await self.nats.close()
        shutil.rmtree(self.socket_root, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    # ------------------------------------------------------------------ steps
    async def _apiserver_ready(self) -> bool:
        if not self.kubeconfig_path.exists():
            return False
        if self.api is None:
            self.api = await kube_api_client(str(self.kubeconfig_path))
        try:
            await client.VersionApi(self.api).get_code()
        except (TimeoutError, OSError, ApiException):
            return False
        return True

    async def api_client(self) -> client.ApiClient:
        assert self.api is not None
        return self.api

    async def _apply(self, group: str, version: str, plural: str, body: dict[str, Any],
                     namespace: str | None = None) -> None:
        custom = client.CustomObjectsApi(self.api)
        try:
            if namespace:
                await custom.create_namespaced_custom_object(group, version, namespace, plural, body)
            else:
                await custom.create_cluster_custom_object(group, version, plural, body)
        except ApiException as exc:
            if exc.status != 409:
                raise

    async def _install_cluster_objects(self) -> None:
        from services.computedomain.crd import crds  # the ComputeDomain service owns its CRDs

        ext = client.ApiextensionsV1Api(self.api)
        for crd in crds():
            with contextlib.suppress(ApiException):
                await ext.create_custom_resource_definition(crd)
        for dc in device_classes("v1"):
            await self._apply("resource.k8s.io", "v1", "deviceclasses", dc)
        core = client.CoreV1Api(self.api)
        for name in ("gpu-dra", "default"):
            with contextlib.suppress(ApiException):
                await core.create_namespace({"metadata": {"name": name}})
        for node in self.node_names:
            body = {"metadata": {"name": node, "labels": {"kubernetes.io/hostname": node,
                                                           "nvidia.com/gpu.present": "true"}},
                    "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}]}}
            with contextlib.suppress(ApiException):
                await core.create_node(body)
        self.progress(f"CRDs, DeviceClasses, Nodes {', '.join(self.node_names)}")

    async def _install_identities(self, kubelets: dict[str, str]) -> None:
        """deploy/'s RBAC and policies plus the embedded components' roles, then a kubeconfig per identity."""
        assert self.api is not None
        await identities.install(self.api, identities.NODE.namespace)
        accounts = {"publisher": identities.PUBLISHER, "controller": identities.CONTROLLER, "node": identities.NODE,
                    "scheduler": identities.SCHEDULER, "controllers": identities.WORKLOAD_CONTROLLERS}
        tokens = {f"kubelet-{node}": token for node, token in kubelets.items()}
        for identity, sa in accounts.items():
            tokens[identity] = await identities.service_account_token(self.api, sa)
        for identity, token in tokens.items():
            self.kubeconfigs[identity] = await identities.write_kubeconfig(
                self.kubeconfig_path, token, self.identities_dir / f"{identity}.kubeconfig")
        self.progress("RBAC and admission policies of deploy/, an identity per service")

    async def _start_cluster_services(self) -> None:
        assert self.supervisor is not None
        mode = ["--mode", "dynamic-mig"] if self.cfg.dynamic_mig else []
        for name, identity, argv in (("publisher", "publisher", ["publisher", *mode]),
                                     ("scheduler", "scheduler", ["scheduler"]),
                                     ("controllers", "controllers", ["controllers"]),
                                     ("computedomain-controller", "controller", ["computedomain", "controller"])):
            flags, env = self._kube(identity)
            if name == "computedomain-controller":
                env = {**env, **ASSIGNED_DOMAINS_ONLY}
            await self.supervisor.start(name, gpu_dra(*argv, *flags), env=env)
        self.progress("publisher, scheduler, controllers, computedomain controller started")

    async def _start_node(self, node: str) -> None:
        assert self.supervisor is not None
        paths = self.node_paths(node)
        for p in paths.values():
            p.mkdir(parents=True, exist_ok=True)
        link = paths["root"] / "var/lib/kubelet"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(paths["kubelet"], target_is_directory=True)
        index = self.node_names.index(node)
        machine = ["--machine", self.cfg.machine] if self.cfg.machine else ["--simulate", self.cfg.node_spec(index)]
        await self.supervisor.start(f"{node}-discovery", gpu_dra(
            "discovery", "--node", node, *machine, "--dev-root", str(paths["root"])))
        await self.supervisor.wait_until(f"{node} inventory", lambda: self._has_inventory(node),
                                         timeout=self.cfg.start_timeout)
        node_flags, node_env = self._kube("node")
        await self.supervisor.start(f"{node}-preparer", gpu_dra(
            "preparer", "--node", node, *node_flags,
            "--registry-dir", str(paths["registry"]), "--plugins-dir", str(paths["plugins"]),
            "--cdi-dir", str(paths["cdi"]), "--dev-root", str(paths["root"])), env=node_env)
        if self.cfg.compute_domains:
            await self.supervisor.start(f"{node}-cd-agent", gpu_dra(
                "computedomain", "agent", "--node", node, "--ip-address", node_ip(index),
                "--state-dir", str(paths["plugins"] / "compute-domain.nvidia.com"),
                "--imex-server-port", str(self.imex_port), "--imex-cmd-port", str(self.imex_port + 1),
                "--imex-daemon", "simulated"),  # no nvidia-imex here: the simulated daemon, each node its own address
                env=ASSIGNED_DOMAINS_ONLY)
        kubelet_flags, kubelet_env = self._kube(f"kubelet-{node}")
        await self.supervisor.start(f"{node}-kubelet", gpu_dra(
            "kubelet", "--node", node, *kubelet_flags,
            "--registry-dir", str(paths["registry"]), "--cdi-dir", str(paths["cdi"])), env=kubelet_env)
        await self.supervisor.wait_until(f"{node} Ready", lambda: self._node_ready(node),
                                         timeout=self.cfg.start_timeout)
        self.progress(f"node {node:<18} discovery, preparer, kubelet ready")

    async def _has_inventory(self, node: str) -> bool:
        assert self.bus is not None
        kv = await self.bus.kv(catalog.INVENTORY_BUCKET)
        return await kv.get(node) is not None

    async def _node_ready(self, node: str) -> bool:
        try:
            obj = await client.CoreV1Api(self.api).read_node(node)
        except ApiException:
            return False
        return any(c.type == "Ready" and c.status == "True" for c in (obj.status.conditions or []))

    async def _slices_published(self) -> bool:
        custom = client.CustomObjectsApi(self.api)
        listed = await custom.list_cluster_custom_object("resource.k8s.io", "v1", "resourceslices")
        nodes = {(s.get("spec") or {}).get("nodeName") for s in listed.get("items") or []
                 if (s.get("spec") or {}).get("driver") == GPU_DRIVER}
        return set(self.node_names) <= nodes


@contextlib.asynccontextmanager
async def local_cluster(progress: Callable[[str], None] | None = None, **settings: Any) -> AsyncIterator[LocalCluster]:
    cfg = msgspec.convert(settings, ClusterConfig)
    async with LocalCluster(cfg, progress) as cluster:
        yield cluster


def cluster_main(config_type: type[C], argv: list[str] | None, *, prog: str, description: str,
                 run: Callable[[C], Awaitable[int]]) -> int:
    """`gpu-dra up` and `gpu-dra demo`: flags -> config (exit 2 naming a bad setting), quiet logs,
    `run(cfg)`; a service that exits while the cluster runs is exit 1, Ctrl-C 130."""
    cfg = load_config_or_report(config_type, argv, prog=prog, description=description)
    if cfg is None:
        return 2
    service = prog.replace(" ", "-")
    setup_logging(service, "warning" if cfg.log_level == "info" else cfg.log_level, cfg.log_format)
    try:
        return asyncio.run(run(cfg))
    except ProcessFailed as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
