"""Node credentials without hand copying: the NATS auth callout end to end.

A real nats-server on the shipped nats.conf with the users.conf `gpu-dra nats credentials` writes
(operator mode, the AUTH account calling out), the real callout (`gpu-dra nats auth-callout` as a
process, under deploy/'s RBAC: only `create tokenreviews`), and the embedded API server issuing
pod-bound ServiceAccount tokens as the kubelet's projected volumes get them. A node service connects
with the sentinel's creds, its token and the identity it asks for (shared.bus, GPU_DRA_NATS_TOKEN_FILE)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.errors
import pytest
import yaml

from embedded.apiserver.testing import RunningApiServer, running_apiserver
from embedded.cluster import identities
from shared.bus import Bus, BusError, NatsTLS
from shared.cli import main as gpu_dra
from shared.events import catalog
from shared.natsjwt import Creds
from shared.ports import free_port
from tests.deploy.conftest import NATS_DIR, ShippedConfigNats, server_env, start_gate

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 10.0
NS = "gpu-dra"


@dataclass
class Setup:
    api: RunningApiServer
    nats: ShippedConfigNats
    sentinel: str  # the sentinel's .creds file
    root: Path
    metrics_url: str
    callout_log: Path

    async def token(self, sa: str, pod: str | None, audiences: tuple[str, ...] = ("nats",), name: str = "token") -> str:
        """A token file as the kubelet projects it: for `sa`, bound to `pod` when given."""
        spec: dict[str, Any] = {"audiences": list(audiences), "expirationSeconds": 3600}
        if pod is not None:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod}
        out = await _admin(self.api, "POST", f"/api/v1/namespaces/{NS}/serviceaccounts/{sa}/token", {"spec": spec})
        path = self.root / "tokens" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(out["status"]["token"])
        return str(path)

    async def bus(self, token_file: str, user: str) -> Bus:
        return await Bus.connect(
            self.nats.url,
            name="t",
            user=user,
            initial_attempts=1,
            tls=NatsTLS(creds_file=self.sentinel, token_file=token_file),
        )

    async def refused(self, token_file: str, user: str) -> None:
        """A plain client (no retries) with the sentinel, this token and name is refused at connect."""
        user_jwt, signature = Creds(Path(self.sentinel).read_text()).callbacks()
        with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
            await nats.connect(
                self.nats.url,
                user_jwt_cb=user_jwt,
                signature_cb=signature,
                token=Path(token_file).read_text(),
                name=user,
                allow_reconnect=False,
                connect_timeout=3,
            )

    async def metrics(self) -> str:
        async with aiohttp.ClientSession() as session, session.get(self.metrics_url) as resp:
            return await resp.text()


async def _until(what: str, condition: Any, timeout: float = WAIT_S) -> None:
    """Poll an async `condition()` until it holds; fail naming `what` after `timeout`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _admin(api: RunningApiServer, method: str, path: str, body: Any = None) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method, api.url + path, json=body, headers={"Authorization": f"Bearer {api.token}"}, ssl=False
        ) as resp,
    ):
        out = await resp.json()
        assert resp.status in (200, 201), (resp.status, out)
        return out


def _secrets(tmp_path: Path) -> dict[str, dict[str, str]]:
    out = tmp_path / "out"
    assert gpu_dra(["nats", "credentials", "--credentials-dir", str(tmp_path / "keys"), "--output", str(out)]) == 0
    docs = [d for d in yaml.safe_load_all((out / "secrets.yaml").read_text()) if d]
    return {d["metadata"]["name"]: d["stringData"] for d in docs}


async def _cluster(api: RunningApiServer) -> None:
    await _admin(api, "POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
    async with api.client() as kube:
        await identities.install(kube, NS)
    await _admin(api, "POST", f"/api/v1/namespaces/{NS}/serviceaccounts", {"metadata": {"name": "tenant-app"}})
    for node in ("gpu-a", "gpu-b"):
        await _admin(api, "POST", "/api/v1/nodes", {"metadata": {"name": node}})
        for sa, pod in (("gpu-dra-node", f"agents-{node}"), ("tenant-app", f"tenant-{node}")):
            await _admin(
                api,
                "POST",
                f"/api/v1/namespaces/{NS}/pods",
                {
                    "metadata": {"name": pod},
                    "spec": {"nodeName": node, "serviceAccountName": sa, "containers": [{"name": "c", "image": "i"}]},
                },
            )


@contextlib.asynccontextmanager
async def _callout_process(env: dict[str, str], log: Path) -> AsyncIterator[None]:
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "shared.cli",
            "nats",
            "auth-callout",
            env=env,
            stdout=out,
            stderr=out,
            cwd=REPO,
            start_new_session=True,
        )
    try:
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while b"nats auth callout ready" not in log.read_bytes():
            assert proc.returncode is None, log.read_text()
            assert asyncio.get_running_loop().time() < deadline, f"callout not ready: {log.read_text()}"
            await asyncio.sleep(0.05)
        yield
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    secrets = _secrets(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "auth").mkdir()
    shutil.copy(NATS_DIR / "nats.conf", tmp_path / "config" / "nats.conf")
    (tmp_path / "auth" / "users.conf").write_text(secrets["gpu-dra-nats-users"]["users.conf"])
    files = tmp_path / "secrets"
    files.mkdir()
    for secret, key in (
        ("gpu-dra-nats-sentinel", "sentinel.creds"),
        ("gpu-dra-nats-auth-callout", "user.creds"),
        ("gpu-dra-nats-auth-callout", "issuer.nk"),
        ("gpu-dra-nats-admin", "user.creds"),
        ("gpu-dra-nats-gate", "user.creds"),
    ):
        (files / secret).mkdir(exist_ok=True)
        (files / secret / key).write_text(secrets[secret][key])
    async with running_apiserver(tmp_path) as api:
        await _cluster(api)
        async with api.client() as kube:
            token = await identities.service_account_token(kube, identities.ServiceAccount(NS, "gpu-dra-auth-callout"))
        kubeconfig = await identities.write_kubeconfig(api.kubeconfig_path, token, tmp_path / "callout.kubeconfig")
        store = tmp_path / "js"
        server = ShippedConfigNats(
            tmp_path / "config" / "nats.conf", server_env("callout-test", store), store, gate=False
        )
        await server.start()
        gate = await start_gate(server.url, creds_file=str(files / "gpu-dra-nats-gate" / "user.creds"))
        port = free_port()
        callout = secrets["gpu-dra-nats-auth-callout"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_")} | {
            "PYTHONPATH": str(REPO),
            "GPU_DRA_NATS_URL": server.url,
            "GPU_DRA_NATS_CREDS": str(files / "gpu-dra-nats-auth-callout" / "user.creds"),
            "GPU_DRA_ISSUER_SEED_FILE": str(files / "gpu-dra-nats-auth-callout" / "issuer.nk"),
            "GPU_DRA_ACCOUNT": callout["account"],
            "GPU_DRA_AUTH_ACCOUNT": callout["auth-account"],
            "GPU_DRA_KUBECONFIG": str(kubeconfig),
            "GPU_DRA_METRICS_PORT": str(port),
        }
        try:
            admin = await Bus.connect(
                server.url,
                name="admin",
                initial_attempts=3,
                tls=NatsTLS(creds_file=str(files / "gpu-dra-nats-admin" / "user.creds")),
            )
            try:
                await admin.provision()
            finally:
                await admin.close()
            log = tmp_path / "callout.log"
            async with _callout_process(env, log):
                yield Setup(
                    api,
                    server,
                    str(files / "gpu-dra-nats-sentinel" / "sentinel.creds"),
                    tmp_path,
                    f"http://127.0.0.1:{port}/metrics",
                    log,
                )
        finally:
            await gate.close()
            await server.close()


async def _plain(setup: Setup, token_file: str, user: str) -> tuple[Any, asyncio.Queue[str]]:
    """A plain nats-py client authorized through the callout, and the server's errors it receives."""
    errors: asyncio.Queue[str] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        errors.put_nowait(str(exc))

    user_jwt, signature = Creds(Path(setup.sentinel).read_text()).callbacks()
    nc = await nats.connect(
        setup.nats.url,
        user_jwt_cb=user_jwt,
        signature_cb=signature,
        token=lambda: Path(token_file).read_text(),
        name=user,
        allow_reconnect=False,
        connect_timeout=3,
        error_cb=on_error,
        inbox_prefix=f"_INBOX_{user.replace('.', '_')}",
    )
    return nc, errors


async def test_node_token_gets_its_node_role_and_nothing_of_another_node(setup: Setup) -> None:
    token_a = await setup.token("gpu-dra-node", "agents-gpu-a", name="a")
    admin_creds = str(setup.root / "secrets" / "gpu-dra-nats-admin" / "user.creds")
    admin = await Bus.connect(setup.nats.url, name="admin", tls=NatsTLS(creds_file=admin_creds), initial_attempts=1)
    seen: asyncio.Queue[str] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        if not msg.subject.startswith("dra.v1.gate."):  # the asks to the state gate, not what it stored
            seen.put_nowait(msg.subject)

    await admin.nc.subscribe("dra.v1.>", cb=on_msg)
    await admin.nc.flush()
    # Through the Bus, as the preparer connects (GPU_DRA_NATS_TOKEN_FILE + the sentinel's creds).
    bus = await setup.bus(token_a, "preparer.gpu-a")
    try:
        own = catalog.CLAIM.format(namespace="team-a", node="gpu-a", event="prepared")
        await bus.js.publish(own, b"{}")  # through the state gate, a node's only way to a stream
        assert await asyncio.wait_for(seen.get(), WAIT_S) == own
        # Its own node's KV key and inventory stay out of reach for the preparer role (discovery's).
        nc, errors = await _plain(setup, token_a, "preparer.gpu-a")
        other = catalog.CLAIM.format(namespace="team-a", node="gpu-b", event="prepared")
        await nc.publish(other, b"{}")
        inventory = catalog.INVENTORY.format(node="gpu-a")
        await nc.publish(inventory, b"{}")
        await nc.flush()
        refusals = {await asyncio.wait_for(errors.get(), WAIT_S) for _ in range(2)}
        assert any("permissions violation for publish" in e.lower() and other in e for e in refusals), refusals
        assert any(inventory in e for e in refusals), refusals
        await nc.close()
        # The same pod's discovery may publish the node's inventory (one pod, three roles, one node).
        discovery, _ = await _plain(setup, token_a, "discovery.gpu-a")
        await discovery.request(f"dra.v1.gate.gpu-a.discovery.PUB.{inventory}", b"{}", timeout=WAIT_S)
        assert await asyncio.wait_for(seen.get(), WAIT_S) == inventory
        await discovery.close()
        assert seen.empty()  # nothing of the refused publishes arrived
    finally:
        await bus.close()
        await admin.close()
    # Node a's token cannot be node b's preparer.
    await setup.refused(token_a, "preparer.gpu-b")
    metrics = await setup.metrics()
    assert 'gpu_dra_nats_auth_callout_total{reason="ok",result="allowed"} 3.0' in metrics
    assert 'gpu_dra_nats_auth_callout_total{reason="identity-not-allowed",result="refused"} 1.0' in metrics


async def test_tokens_that_name_no_node_role_are_refused(setup: Setup) -> None:
    cases = [
        (
            await setup.token(
                "gpu-dra-node",
                "agents-gpu-a",
                audiences=("https://kubernetes.default.svc.cluster.local",),
                name="api-audience",
            ),
            "audience",
        ),
        (await setup.token("gpu-dra-node", None, name="unbound"), "not-node-bound"),
        (await setup.token("tenant-app", "tenant-gpu-a", name="tenant"), "unknown-service-account"),
    ]
    unknown = setup.root / "tokens" / "unknown"
    unknown.write_text("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJub2JvZHkifQ.c2lnbmF0dXJl")
    cases.append((str(unknown), "unauthenticated"))
    # A token whose pod is gone is dead, as a stale or stolen projected token must be.
    gone = await setup.token("gpu-dra-node", "agents-gpu-b", name="gone")
    await _admin(setup.api, "DELETE", f"/api/v1/namespaces/{NS}/pods/agents-gpu-b?gracePeriodSeconds=0")
    cases.append((gone, "unauthenticated"))
    for token_file, _ in cases:
        await setup.refused(token_file, "preparer.gpu-a")
    metrics = await setup.metrics()
    for reason in ("audience", "not-node-bound", "unknown-service-account"):
        assert f'gpu_dra_nats_auth_callout_total{{reason="{reason}",result="refused"}} 1.0' in metrics, reason
    assert 'gpu_dra_nats_auth_callout_total{reason="unauthenticated",result="refused"} 2.0' in metrics
    assert 'result="allowed"' not in metrics
    log = setup.callout_log.read_text()
    assert "nats connect refused" in log and "system:serviceaccount:gpu-dra:tenant-app has no NATS role" in log


async def test_the_token_is_read_again_at_every_connect(setup: Setup) -> None:
    """The kubelet rotates the projected token in place; the bus sends what the file holds when it
    (re)connects: a wrong token keeps it out, the next good one lets it back in as the same identity."""
    path = Path(await setup.token("gpu-dra-node", "agents-gpu-a", name="rotating"))
    bus = await setup.bus(str(path), "preparer.gpu-a")
    try:
        path.write_text(
            Path(await setup.token("gpu-dra-node", "agents-gpu-a", audiences=("other",), name="wrong")).read_text()
        )
        await setup.nats.restart()

        async def refused_for_audience() -> bool:
            return 'reason="audience",result="refused"' in await setup.metrics()

        await _until("the reconnect with the wrong token to be refused", refused_for_audience)
        assert not bus.connected
        path.write_text(Path(await setup.token("gpu-dra-node", "agents-gpu-a", name="fresh")).read_text())

        async def connected() -> bool:
            return bus.connected

        await _until("the bus to reconnect with the fresh token", connected, timeout=20)
        own = catalog.CLAIM.format(namespace="team-a", node="gpu-a", event="prepared")
        await bus.js.publish(own, b"{}")
    finally:
        await bus.close()


def test_callout_settings_that_cannot_work_stop_it_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.authcallout.cli import main as callout_main
    from services.authcallout.service import parse_roles

    assert parse_roles("gpu-dra/gpu-dra-node=discovery,preparer") == {
        "system:serviceaccount:gpu-dra:gpu-dra-node": ("discovery", "preparer")
    }
    for bad, complaint in (
        ("gpu-dra/x=admin", "unknown role"),
        ("gpu-dra-node=preparer", "expected NAMESPACE/"),
        ("", "no service account"),
    ):
        with pytest.raises(ValueError, match=complaint):
            parse_roles(bad)
    seed = tmp_path / "issuer.nk"
    seed.write_text("not a seed")
    base = ["--nats-url", "nats://127.0.0.1:1", "--nats-creds", "x", "--account", "A", "--auth-account", "B"]
    assert callout_main(base) == 2
    assert "--issuer-seed-file is required" in capsys.readouterr().err
    assert callout_main([*base, "--issuer-seed-file", str(seed)]) == 2
    assert "gpu-dra-nats-auth-callout" in capsys.readouterr().err


async def test_a_token_without_the_sentinel_or_an_identity_is_refused_before_connecting(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    with pytest.raises(BusError, match="needs GPU_DRA_NATS_CREDS"):
        await Bus.connect(
            "nats://127.0.0.1:1",
            name="t",
            user="preparer.gpu-a",
            initial_attempts=1,
            tls=NatsTLS(token_file=str(token)),
        )
    creds = tmp_path / "sentinel.creds"
    creds.write_text(_secrets(tmp_path)["gpu-dra-nats-sentinel"]["sentinel.creds"])
    with pytest.raises(BusError, match="needs GPU_DRA_NATS_USER"):
        await Bus.connect(
            "nats://127.0.0.1:1",
            name="t",
            initial_attempts=1,
            tls=NatsTLS(creds_file=str(creds), token_file=str(token)),
        )
    with pytest.raises(BusError, match="cannot read the NATS token"):
        await Bus.connect(
            "nats://127.0.0.1:1",
            name="t",
            user="preparer.gpu-a",
            initial_attempts=1,
            tls=NatsTLS(creds_file=str(creds), token_file=str(tmp_path / "missing")),
        )
