"""A whole local GPU cluster on one machine: NATS, the API server and every service as its own process.

Owns the layout of the data directory, the order things start in and what "ready" means for each
(observed effects, not timers: the API server answers, a node's inventory is in KV, its plugin
sockets exist and its Node is Ready, its ResourceSlices are published), keeping nats-server and every
service running (processes.py restarts one that dies), and the teardown, which completes even when
interrupted and leaves no process and no temporary directory behind.

nats-server runs with the deployment's NATS users (natsidentities.py): every service connects as its own
user, given by a .creds file named in its environment, and `up` itself as the admin.

Started again on the same data directory, it resumes: API objects, checkpoints, JetStream data and the
NATS keys are kept; the kubeconfigs, tokens and NATS user JWTs are new (the old ones name a server that is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import msgspec
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.cluster import clusterobjects, identities, webhook
from embedded.cluster.clusterconfig import NATS_IDENTITY
from embedded.cluster.clusterconfig import PER_SERVICE as PER_SERVICE  # re-exported
from embedded.cluster.clusterconfig import SHARED_SETTINGS as SHARED_SETTINGS  # re-exported
from embedded.cluster.clusterconfig import ClusterConfig as ClusterConfig  # re-exported
from embedded.cluster.clusterconfig import publisher_argv as publisher_argv  # re-exported
from embedded.cluster.natsidentities import ADMIN, CONTROLLER, PUBLISHER, NatsIdentities, issue_identities
from embedded.cluster.processes import RESTARTS, RUNNING, Supervisor, describe_exit, gpu_dra
from embedded.cluster.tempdirs import DATA_PREFIX, RUNTIME_PREFIX, sweep_orphaned_dirs
from services.discovery.config import sim_state_file, simulated_state_dir
from shared.backoff import Backoff
from shared.bus import Bus, NatsTLS
from shared.config import settings_env
from shared.events import catalog
from shared.kube.client import kube_api_client
from shared.logs import get_logger
from shared.natsserver import EmbeddedNats
from shared.natstarget import LOCAL_CLUSTER_FILE
from shared.natsusers import DASHBOARD_READER, GATE_ROLE, node_user, reader_user
from shared.ports import free_port, next_free_port
from shared.tasks import cancel_and_wait, finish_even_if_cancelled

log = get_logger(__name__)
GPU_DRIVER = "gpu.nvidia.com"
# the ComputeDomain controller assigns domains from allocated claims; agents count only those (docs/security.md)
ASSIGNED_DOMAINS_ONLY = {"GPU_DRA_REQUIRE_ASSIGNMENT": "true"}


def node_ip(index: int) -> str:
    """A loopback address of a node's own, so that IMEX daemons of several nodes share one port."""
    return f"127.0.{90 + index // 200}.{1 + index % 200}"


class LocalCluster:
    """`async with LocalCluster(cfg, progress=print) as cluster:` a running cluster."""

    def __init__(self, cfg: ClusterConfig, progress: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.progress = progress or (lambda line: None)
        self._own_dir = not cfg.data_dir
        self.data_dir = Path(cfg.data_dir or tempfile.mkdtemp(prefix=f"{DATA_PREFIX}{os.getpid()}-"))
        self.kubeconfig_path = Path(cfg.kubeconfig) if cfg.kubeconfig else self.data_dir / "kubeconfig"
        self.node_names = [f"{cfg.node_prefix}{i}" for i in range(cfg.nodes)]
        self.nats: EmbeddedNats | None = None
        self._nats_keeper: asyncio.Task[None] | None = None
        self.nats_restarts = 0
        self.nats_url = cfg.nats_url
        # the deployment's NATS users, one .creds per identity; None with --nats-url (that server's auth is yours)
        self.nats_identities: NatsIdentities | None = None
        self.supervisor: Supervisor | None = None
        self.api: client.ApiClient | None = None
        self.bus: Bus | None = None
        self.identities_dir = self.data_dir / "identities"  # a kubeconfig per identity, and the token file
        self.pod_log_dir = self.data_dir / "pod-logs"  # every kubelet writes here, the API server's pods/log reads
        self.kubeconfigs: dict[str, Path] = {}
        self.extra_env: dict[str, str] = {}
        self.metrics_ports: dict[str, int] = {}  # service -> its /metrics port (with --metrics-port)
        # Unix socket paths are limited to 107 bytes, which a deep --data-dir easily exceeds, so the
        # services are given the kubelet dirs (sockets, checkpoints) as <short runtime dir>/<index>, a
        # link to <node>/var/lib/kubelet in the data dir: the state stays in the data dir, the paths short.
        self.socket_root = Path(tempfile.mkdtemp(prefix=f"{RUNTIME_PREFIX}{os.getpid()}-", dir="/tmp"))
        self.imex_port = free_port()  # every node's IMEX daemon listens on it, each on its node's address
        self.dashboard_url = ""  # the fleet page, once started

    def node_dir(self, node: str) -> Path:
        return self.data_dir / "nodes" / node

    def node_paths(self, node: str) -> dict[str, Path]:
        root = self.node_dir(node)
        kubelet = self.socket_root / str(self.node_names.index(node))
        return {
            "root": root,
            "state": root / "var/lib/kubelet",
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
            await finish_even_if_cancelled(self.stop())
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await finish_even_if_cancelled(self.stop())

    def _env(self) -> dict[str, str]:
        """What every service gets: SHARED_SETTINGS as up has them, and (the Supervisor passes on no GPU_DRA_*
        variable of up's environment) nothing of up's own settings (GPU_DRA_NODES, ...), which it would refuse.
        No process inherits the admin's kubeconfig: each gets its own identity's (`_kube`), or none.
        POD_NAMESPACE as a pod in deploy/'s namespace has it (the controller's Lease lives there).
        When up runs the server a process is only the NATS user `_nats` gives it; with --nats-url, up's identity."""
        identity = (
            {}
            if self.nats_identities
            else settings_env(self.cfg, [name for name in NATS_IDENTITY if getattr(self.cfg, name)])
        )
        gates = {"GPU_DRA_FEATURE_GATES": self.cfg.gate_setting()} if self.cfg.gate_setting() else {}
        return {
            **settings_env(self.cfg, SHARED_SETTINGS),
            "GPU_DRA_NATS_URL": self.nats_url,
            "GPU_DRA_LOG_FORMAT": "json",
            "KUBECONFIG": "",
            "POD_NAMESPACE": identities.NODE.namespace,
            **identity,
            **gates,
            **self.extra_env,
        }

    def _nats(self, user: str) -> dict[str, str]:
        """The environment that makes a process the NATS user `user` (its .creds file; none with --nats-url)."""
        return self.nats_identities.env(user) if self.nats_identities else {}

    def _nats_tls(self, user: str) -> NatsTLS | None:
        return self.nats_identities.tls(user) if self.nats_identities else None

    def _kube(self, identity: str) -> tuple[list[str], dict[str, str]]:
        """The flags and environment that make a process `identity` (a kubeconfig file path, not a token)."""
        path = str(self.kubeconfigs[identity])
        return ["--kubeconfig", path], {"KUBECONFIG": path}

    def nats_env(self) -> dict[str, str]:
        """How a tool reaches this cluster's NATS as up's own identity (`gpu-dra events tail`)."""
        env = {"GPU_DRA_NATS_URL": self.nats_url}
        if self.nats_identities:
            env.update(self.nats_identities.env(ADMIN))
        return env

    def _write_nats_file(self) -> None:
        """<data-dir>/nats.json: the URL and up's credential, for `gpu-dra events tail` (0600)."""
        env = self.nats_env()
        text = (
            json.dumps(
                {
                    "url": env["GPU_DRA_NATS_URL"],
                    "creds": env.get("GPU_DRA_NATS_CREDS", ""),
                    "user": env.get("GPU_DRA_NATS_USER", ""),
                },
                indent=2,
            )
            + "\n"
        )
        identities.write_secret(self.data_dir / LOCAL_CLUSTER_FILE, text)

    async def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.runtime == "sandbox" and shutil.which("bwrap") is None:
            self.progress(
                "containers will NOT run: bubblewrap (bwrap) is not installed; `apt-get install -y "
                "bubblewrap` (or `make sandbox`) and start again. Running with --runtime none."
            )
            self.cfg = msgspec.structs.replace(self.cfg, runtime="none")
        await asyncio.to_thread(self._forget_previous_run)
        await asyncio.to_thread(sweep_orphaned_dirs)
        if not self.nats_url:
            ids = self.nats_identities = await issue_identities(self.identities_dir, self.node_names)
            self.nats = EmbeddedNats(store_dir=self.data_dir / "nats", config_file=ids.server_config)
            await self.nats.start()
            self.nats_url = self.nats.url
            self._nats_keeper = asyncio.create_task(self._keep_nats_running(), name="supervise-nats-server")
        users = f" (a NATS user per service: {self.identities_dir / 'nats'})" if self.nats_identities else ""
        self.progress(f"nats-server (JetStream)   {self.nats_url}{users}")
        # up itself is the admin: it provisions the streams and buckets, as a deployment's init does
        self.bus = await Bus.connect(self.nats_url, name="gpu-dra-up", tls=self._nats_tls(ADMIN))
        await self.bus.provision()
        await asyncio.to_thread(self._write_nats_file)
        sup = self.supervisor = Supervisor(self.data_dir / "logs", self._env(), report=self.progress)
        port = free_port()
        kubelets = identities.kubelet_tokens(self.node_names)
        token_file = await asyncio.to_thread(
            identities.write_secret, self.identities_dir / "tokens.csv", identities.token_file_text(kubelets)
        )
        # The admin's token is made by the server and written only into its kubeconfig (0600); a restarted
        # server writes a new one there (kubectl reads the file afresh; the services have their own).
        await sup.start(
            "apiserver",
            gpu_dra(
                "apiserver",
                "--port",
                str(port),
                "--kubeconfig",
                str(self.kubeconfig_path),
                "--data-dir",
                str(self.data_dir / "apiserver"),
                "--token-auth-file",
                str(token_file),
                "--pod-log-dir",
                str(self.pod_log_dir),
            ),
        )
        await sup.wait_until("the API server", self._apiserver_ready, timeout=self.cfg.start_timeout)
        self.progress(f"API server                https://127.0.0.1:{port} (kubeconfig {self.kubeconfig_path})")
        await self._install_cluster_objects()
        await self._install_identities(kubelets)
        await self._start_cluster_services()
        await asyncio.gather(*(self._start_node(node) for node in self.node_names))
        if self.metrics_ports:
            await asyncio.to_thread(
                (self.data_dir / "metrics.json").write_text, json.dumps(self.metrics_ports, indent=2) + "\n"
            )
        await sup.wait_until("ResourceSlices for every node", self._slices_published, timeout=self.cfg.start_timeout)
        self.progress(f"ResourceSlices published  {len(self.node_names)} node(s)")
        if self.dashboard_url:
            await sup.wait_until("the fleet page", self._dashboard_ready, timeout=self.cfg.start_timeout)
            await asyncio.to_thread((self.data_dir / "dashboard.url").write_text, self.dashboard_url + "\n")
            self.progress(f"fleet page                {self.dashboard_url}")

    async def stop(self) -> None:
        """Everything down, whatever state start() got to; run it to its end (finish_even_if_cancelled)."""
        self.progress("stopping: every service, nats-server, the temporary dirs")
        if self._nats_keeper is not None:
            await cancel_and_wait([self._nats_keeper])
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.api is not None:
            with contextlib.suppress(Exception):
                await self.api.close()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.close()
        if self.nats is not None:
            await self.nats.close()
        await asyncio.to_thread(self._remove_runtime_files)

    def _remove_runtime_files(self) -> None:
        shutil.rmtree(self.socket_root, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            return
        for node in self.node_names:  # sockets of services that are gone; the state beside them stays
            for sock in self.node_paths(node)["state"].rglob("*.sock"):
                sock.unlink(missing_ok=True)

    def running(self) -> bool:
        """Every process of the cluster runs now (none is waiting out a restart backoff)."""
        processes = [c.process for c in self.supervisor.children] if self.supervisor else []
        if self.nats is not None:
            processes.append(self.nats.proc)
        return bool(processes) and all(p is not None and p.returncode is None for p in processes)

    def _forget_previous_run(self) -> None:
        """On a data dir used before: the kubeconfigs name a server (port, token) that is gone, so they are
        removed before the new server writes its own, and readiness is never judged by a stale file."""
        for stale in (self.kubeconfig_path, *self.identities_dir.glob("*.kubeconfig")):
            stale.unlink(missing_ok=True)

    async def _keep_nats_running(self) -> None:
        """Restart nats-server (same port, same store) when it dies, with the project's backoff."""
        assert self.nats is not None and self.nats.proc is not None
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        started = loop.time()
        RUNNING.labels("nats-server").set(1)
        while True:
            assert self.nats.proc is not None
            code = await self.nats.proc.wait()
            RUNNING.labels("nats-server").set(0)
            backoff.ran(loop.time() - started)
            delay = backoff.next()
            log.error(
                "nats-server exited; restarting it",
                code=code,
                restarts=self.nats_restarts + 1,
                backoff_s=delay,
                log=str(self.nats.log_path),
            )
            self.progress(
                f"nats-server {describe_exit(code)}; restarting in {delay:.1f}s "
                f"(restart {self.nats_restarts + 1}); log {self.nats.log_path}"
            )
            await asyncio.sleep(delay)
            started = loop.time()  # a start that fails is a short run: the backoff grows
            try:
                await self.nats.start()
            except Exception as exc:  # noqa: BLE001 - retried with backoff, like any service
                log.error("nats-server did not come back", error=str(exc))
                self.progress(f"nats-server did not come back: {exc}")
                continue
            self.nats_restarts += 1
            RESTARTS.labels("nats-server").inc()
            RUNNING.labels("nats-server").set(1)
            self.progress(
                f"nats-server restarted (pid {self.nats.proc.pid if self.nats.proc else 0}, "
                f"restart {self.nats_restarts})"
            )

    # ------------------------------------------------------------------ steps
    async def _apiserver_ready(self) -> bool:
        if not self.kubeconfig_path.exists():
            return False  # removed at start: it appears when this run's server has written it
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

    async def _install_cluster_objects(self) -> None:
        assert self.api is not None
        await clusterobjects.install(self.api, self.node_names, self.cfg.node_config, self.progress)

    async def _install_identities(self, kubelets: dict[str, str]) -> None:
        """deploy/'s RBAC and policies plus the embedded components' roles, then a kubeconfig per identity."""
        assert self.api is not None
        await identities.install(self.api, identities.NODE.namespace)
        accounts = {
            "publisher": identities.PUBLISHER,
            "controller": identities.CONTROLLER,
            "node": identities.NODE,
            "dashboard": identities.DASHBOARD,
            "scheduler": identities.SCHEDULER,
            "controllers": identities.WORKLOAD_CONTROLLERS,
        }
        tokens = {f"kubelet-{node}": token for node, token in kubelets.items()}
        for identity, sa in accounts.items():
            tokens[identity] = await identities.service_account_token(self.api, sa)
        for identity, token in tokens.items():
            self.kubeconfigs[identity] = await identities.write_kubeconfig(
                self.kubeconfig_path, token, self.identities_dir / f"{identity}.kubeconfig"
            )
        self.progress("RBAC and admission policies of deploy/, an identity per service")

    async def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        """Start a service under the supervisor; with `--metrics-port BASE`, it serves /metrics on the next
        free port after BASE and the ports already given (`<data-dir>/metrics.json` maps each service to its
        port). A port held by anything else, a connection's local port among them, is passed over: the
        service would fail to bind it at every restart."""
        assert self.supervisor is not None
        extra = {}
        if self.cfg.metrics_port > 0:
            port = self.metrics_ports.get(name)
            if port is None:
                port = self.metrics_ports[name] = next_free_port(
                    max(self.metrics_ports.values(), default=self.cfg.metrics_port)
                )
            extra = {"GPU_DRA_METRICS_PORT": str(port)}
        await self.supervisor.start(name, argv, env={**(env or {}), **extra})

    async def _start_cluster_services(self) -> None:
        assert self.supervisor is not None
        if self.nats_identities:  # node identities reach JetStream only through it (services/stategate)
            await self._start("state-gate", gpu_dra("state-gate"), env=self._nats(GATE_ROLE))
        for name, identity, argv in (
            ("publisher", "publisher", publisher_argv(self.cfg)),
            ("scheduler", "scheduler", ["scheduler"]),
            ("controllers", "controllers", ["controllers"]),
            ("computedomain-controller", "controller", ["computedomain", "controller"]),
        ):
            flags, env = self._kube(identity)
            if name == "publisher":
                env = {**env, **self._nats(PUBLISHER)}
            if name == "computedomain-controller":
                env = {**env, **ASSIGNED_DOMAINS_ONLY, **self._nats(CONTROLLER)}
            await self._start(name, gpu_dra(*argv, *flags), env=env)
        if self.cfg.dashboard:
            await self._start_dashboard()
        await self._start_webhook()
        self.progress("state gate, publisher, scheduler, controllers, computedomain controller, webhook started")

    async def _start_webhook(self) -> None:
        """The admission webhook (embedded/cluster/webhook.py), registered once it serves."""
        assert self.supervisor is not None and self.api is not None
        cert_dir, port = self.data_dir / "webhook", free_port()
        await self._start("webhook", gpu_dra(*webhook.webhook_argv(cert_dir, port)))
        await self.supervisor.wait_until(
            "the admission webhook", lambda: webhook.ready(cert_dir, port), timeout=self.cfg.start_timeout
        )
        await webhook.register(self.api, cert_dir, port)

    async def _start_dashboard(self) -> None:
        """`gpu-dra dashboard` as deploy/'s dashboard identity and the reader.dashboard NATS user, everything
        visible (--auth none: the machine's user is the cluster's admin), claims' waterfalls from traces.jsonl."""
        port = self.cfg.dashboard_port or free_port()
        flags, env = self._kube("dashboard")
        await self._start(
            "dashboard",
            gpu_dra(
                "dashboard",
                "--listen",
                f"127.0.0.1:{port}",
                "--auth",
                "none",
                "--span-store",
                str(self.data_dir / "traces.jsonl"),
                *flags,
            ),
            env={**env, **self._nats(reader_user(DASHBOARD_READER))},
        )
        self.dashboard_url = f"http://127.0.0.1:{port}/"

    async def _start_node(self, node: str) -> None:
        assert self.supervisor is not None
        paths = self.node_paths(node)
        state = paths["state"]
        if state.is_symlink():
            state.unlink()  # the layout of older versions: the state lived in the runtime dir
        for key in ("root", "state", "cdi"):
            paths[key].mkdir(parents=True, exist_ok=True)
        paths["kubelet"].symlink_to(state, target_is_directory=True)
        for key in ("registry", "plugins"):
            paths[key].mkdir(parents=True, exist_ok=True)
        index = self.node_names.index(node)
        machine = ["--machine", self.cfg.machine] if self.cfg.machine else ["--simulate", self.cfg.node_spec(index)]
        await self._start(
            f"{node}-discovery",
            gpu_dra(
                "discovery",
                "--node",
                node,
                *machine,
                "--dev-root",
                str(paths["root"]),
                *(["--fabric-manager-partitions"] if self.cfg.nvlink_partitions else []),
            ),
            env=self._nats(node_user("discovery", node)),
        )
        await self.supervisor.wait_until(
            f"{node} inventory", lambda: self._has_inventory(node), timeout=self.cfg.start_timeout
        )
        node_flags, node_env = self._kube("node")
        await self._start(
            f"{node}-preparer",
            gpu_dra(
                "preparer",
                "--node",
                node,
                *node_flags,
                "--registry-dir",
                str(paths["registry"]),
                "--plugins-dir",
                str(paths["plugins"]),
                "--cdi-dir",
                str(paths["cdi"]),
                "--dev-root",
                str(paths["root"]),
                # the simulated node's sysfs and (process-less) proc: VFIO passthrough moves its GPUs there
                "--sys-root",
                str(paths["root"]),
                "--proc-root",
                str(paths["root"]),
            ),
            env={**node_env, **self._nats(node_user("preparer", node))},
        )
        if self.cfg.compute_domains:
            await self._start(
                f"{node}-cd-agent",
                gpu_dra(
                    "computedomain",
                    "agent",
                    "--node",
                    node,
                    "--ip-address",
                    node_ip(index),
                    "--state-dir",
                    str(paths["plugins"] / "compute-domain.nvidia.com"),
                    "--imex-server-port",
                    str(self.imex_port),
                    "--imex-cmd-port",
                    str(self.imex_port + 1),
                    "--imex-daemon",
                    "simulated",
                ),  # no nvidia-imex here: the simulated daemon, each node its own address
                env={**ASSIGNED_DOMAINS_ONLY, **self._nats(node_user("cd-agent", node))},
            )
        kubelet_flags, kubelet_env = self._kube(f"kubelet-{node}")
        await self._start(
            f"{node}-kubelet",
            gpu_dra(
                "kubelet",
                "--node",
                node,
                *kubelet_flags,
                "--registry-dir",
                str(paths["registry"]),
                "--cdi-dir",
                str(paths["cdi"]),
                "--runtime",
                self.cfg.runtime,
                "--backoff-seconds",
                str(self.cfg.restart_backoff),
                "--pod-log-dir",
                str(self.pod_log_dir),
                "--sim-state",
                str(sim_state_file(simulated_state_dir(paths["root"]), node)),
            ),
            env=kubelet_env,
        )
        await self.supervisor.wait_until(
            f"{node} Ready", lambda: self._node_ready(node), timeout=self.cfg.start_timeout
        )
        self.progress(f"node {node:<18} discovery, preparer, kubelet ready")

    async def _dashboard_ready(self) -> bool:
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.get(self.dashboard_url + "healthz", timeout=aiohttp.ClientTimeout(total=2)) as resp,
            ):
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

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
        nodes = {
            (s.get("spec") or {}).get("nodeName")
            for s in listed.get("items") or []
            if (s.get("spec") or {}).get("driver") == GPU_DRIVER
        }
        return set(self.node_names) <= nodes


@contextlib.asynccontextmanager
async def local_cluster(progress: Callable[[str], None] | None = None, **settings: Any) -> AsyncIterator[LocalCluster]:
    cfg = msgspec.convert(settings, ClusterConfig)
    async with LocalCluster(cfg, progress) as cluster:
        yield cluster
