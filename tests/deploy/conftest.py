"""Helpers for the deployment tests: render Kustomize overlays once, generate NATS users, and
run the shipped nats-server configs with test credentials."""

from __future__ import annotations

import asyncio
import atexit
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import nats.errors
import nats.js.errors
import pytest
import yaml

from services.stategate.gate import StateGate
from services.stategate.quota import Share
from shared.bus import Bus, NatsTLS
from shared.natsserver import EmbeddedNats, nats_server_binary
from shared.natsusers import GATE_ROLE
from shared.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
NATS_DIR = DEPLOY / "nats"
OVERLAYS = ("dev", "production")
CLUSTER_NODES = ["gpu-a", "gpu-b"]  # the GPU nodes the `nats_cluster` fixture's users are generated for
CLUSTER_SIZE = 3
ROUTE_PASSWORD = "route-test-pw"
V1BETA1_COMPONENT = KUBERNETES / "components" / "resource-v1beta1"


def kubectl_binary() -> str:
    found = shutil.which("kubectl")
    if not found:
        pytest.skip("kubectl is not installed: `kubectl kustomize` renders the overlays")
    return found


@functools.cache
def _render(path: str) -> tuple[dict[str, Any], ...]:
    proc = subprocess.run(
        [kubectl_binary(), "kustomize", path], capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} failed:\n{proc.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def render(path: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize <path>` renders (cached per path)."""
    return [dict(obj) for obj in _render(str(path))]


def render_overlay(name: str) -> list[dict[str, Any]]:
    return render(KUBERNETES / "overlays" / name)


@functools.cache
def _with_v1beta1_dir(name: str) -> Path:
    """A kustomization beside nothing in the repo: the overlay plus the 1.32/1.33 component."""
    root = Path(tempfile.mkdtemp(prefix=f"gpu-dra-{name}-v1beta1-"))
    atexit.register(shutil.rmtree, root, True)
    overlay = KUBERNETES / "overlays" / name
    (root / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # kustomize takes relative paths only
                "resources": [os.path.relpath(overlay, root)],
                "components": [os.path.relpath(V1BETA1_COMPONENT, root)],
            }
        )
    )
    return root


def render_overlay_v1beta1(name: str) -> list[dict[str, Any]]:
    return render(_with_v1beta1_dir(name))


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind}/{name} among {[(o['kind'], o['metadata']['name']) for o in objects]}")


def nats_users_module() -> ModuleType:
    """deploy/nats/nats_users.py, imported from its path (deploy/ is not a package)."""
    name = "gpu_dra_deploy_nats_users"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, NATS_DIR / "nats_users.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_password(user: str) -> str:
    return f"test-{user}-pw"


test_password.__test__ = False  # type: ignore[attr-defined]


def nats_layout(tmp_path: Path, nodes: list[str], readers: dict[str, list[str]] | None = None) -> Path:
    """The shipped configs under <tmp>/config and generated users (test passwords) under <tmp>/auth,
    the same layout as the StatefulSet's mounts; `readers`: {reader name: namespaces}. Returns the
    config directory."""
    users_mod = nats_users_module()
    config_dir = tmp_path / "config"
    auth_dir = tmp_path / "auth"
    config_dir.mkdir(parents=True)
    auth_dir.mkdir(parents=True)
    for conf in ("nats.conf", "nats-cluster.conf", "tls.conf"):
        shutil.copy(NATS_DIR / conf, config_dir / conf)
    users = users_mod.all_users(nodes, readers)
    passwords = {name: test_password(name) for name in users}
    (auth_dir / "users.conf").write_text(users_mod.render_authorization(users, passwords))
    return config_dir


class ShippedConfigNats(EmbeddedNats):
    """nats-server run on a shipped config file with its per-server environment (the values the
    StatefulSet sets), on loopback. The store, ports and routes come from `env`, not flags."""

    def __init__(self, config_file: Path, env: dict[str, str], store_dir: Path, *, gate: bool = True) -> None:
        super().__init__(store_dir=store_dir, port=int(env["NATS_CLIENT_PORT"]), config_file=config_file)
        self.env = env
        self.gate = gate  # run a state gate on it, as a deployment does (node users reach JetStream through it)
        self._gate_bus: Bus | None = None

    async def start(self, timeout: float = 15.0) -> None:
        await super().start(timeout=timeout)
        if self.gate:
            self._gate_bus = await start_gate(self.url)

    async def close(self) -> None:
        if self._gate_bus is not None:
            await self._gate_bus.close()
            self._gate_bus = None
        await super().close()

    def _args(self) -> list[str]:
        assert self.config_file is not None
        inherited = [f"{k}={v}" for k, v in sorted(self.env.items())]
        return [
            shutil.which("env") or "/usr/bin/env",
            *inherited,
            nats_server_binary(),
            "-a",
            "127.0.0.1",
            "-c",
            str(self.config_file),
        ]


async def start_gate(url: str, share: Share | None = None, *, creds_file: str = "") -> Bus:
    """A state gate (services/stategate) serving on `url` as the shipped `gate` user (its test password, or
    the .creds file of a JWT deployment); close the bus to stop it."""
    if creds_file:
        bus = await Bus.connect(url, name="state-gate", tls=NatsTLS(creds_file=creds_file), initial_attempts=5)
    else:
        bus = await Bus.connect(
            url, name="state-gate", user=GATE_ROLE, password=test_password(GATE_ROLE), initial_attempts=5
        )
    await StateGate(bus, share or Share(rate=64 * 1024, burst=8 << 20)).start()
    return bus


def server_env(name: str, store: Path, **extra: str) -> dict[str, str]:
    return {
        "NATS_SERVER_NAME": name,
        "NATS_CLIENT_PORT": str(free_port()),
        "NATS_MONITOR_PORT": str(free_port()),
        "NATS_STORE_DIR": str(store),
        **extra,
    }


@pytest.fixture
async def nats_cluster(tmp_path: Path) -> AsyncIterator[list[ShippedConfigNats]]:
    """Three nats-server processes as one JetStream cluster on loopback, each on the shipped cluster
    config with users generated for CLUSTER_NODES (passwords from `test_password`)."""
    config = nats_layout(tmp_path, CLUSTER_NODES) / "nats-cluster.conf"
    cluster_ports = [free_port() for _ in range(CLUSTER_SIZE)]
    routes = {
        f"NATS_ROUTE_{i}": f"nats-route://route:{ROUTE_PASSWORD}@127.0.0.1:{port}"
        for i, port in enumerate(cluster_ports)
    }
    servers = []
    for i, port in enumerate(cluster_ports):
        store = tmp_path / f"nats-{i}"
        env = server_env(
            f"gpu-dra-nats-{i}",
            store / "jetstream",
            NATS_CLUSTER_PORT=str(port),
            NATS_ROUTE_PASSWORD=ROUTE_PASSWORD,
            **routes,
        )
        servers.append(ShippedConfigNats(config, env, store))
    try:
        await asyncio.gather(*(s.start(timeout=30) for s in servers))
        # The first JetStream call made before the meta leader is elected waits out its request timeout
        # (~5 s); the election itself takes well under a second.
        await asyncio.gather(*(wait_healthy(s) for s in servers))
        yield servers
    finally:
        await asyncio.gather(*(s.close() for s in servers))


async def wait_healthy(server: ShippedConfigNats, timeout: float = 30.0) -> None:
    """Until the member's /healthz answers 200: JetStream current with the meta leader (no event says so)."""
    url = f"http://127.0.0.1:{server.env['NATS_MONITOR_PORT']}/healthz"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.02
    while not await asyncio.to_thread(healthy):
        assert loop.time() < deadline, f"{url} not healthy within {timeout}s"
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)


def cluster_urls(servers: list[ShippedConfigNats]) -> str:
    """GPU_DRA_NATS_URL for these servers: every client URL, comma-separated."""
    return ",".join(s.url for s in servers)


def server_name(server: ShippedConfigNats) -> str:
    return server.env["NATS_SERVER_NAME"]


async def wait_for_meta_leader(bus: Bus, timeout: float = 30.0) -> None:
    """Retries while the cluster elects its JetStream meta leader (no event tells us when)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await bus.js.account_info()
            return
        except (nats.errors.Error, nats.js.errors.Error):
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)
