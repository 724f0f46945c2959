"""A real `gpu-dra preparer` process: the gRPC health service on --healthcheck-port over real gRPC (Check and
Watch; SERVING only while both drivers answer on their own sockets), and /readyz on --metrics-port (ready once
the kubelet has registered each driver)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from embedded.kubelet.client import register
from services.preparer.protos import grpc_health_v1_pb2 as pb2
from services.preparer.protos import grpc_health_v1_pb2_grpc as pb2_grpc
from shared.natsserver import EmbeddedNats
from shared.ports import free_port
from tests.discovery.test_endpoint import get, wait_for
from tests.preparer.helpers import node_config

REPO = Path(__file__).resolve().parents[2]
DRIVERS = ("gpu.nvidia.com", "compute-domain.nvidia.com")
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:9"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@dataclass
class Preparer:
    proc: asyncio.subprocess.Process
    log: Path
    health_port: int
    metrics_port: int
    registry: Path
    plugins: Path


@pytest.fixture
async def preparer(root: Path, nats_server: EmbeddedNats) -> AsyncIterator[Preparer]:
    cfg = node_config(root)
    (root / "kubeconfig").write_text(KUBECONFIG)
    health_port, metrics_port = free_port(), free_port()
    log = root / "preparer.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_")}
    with open(log, "wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "shared.cli",
            "preparer",
            "--node",
            "n1",
            "--registry-dir",
            cfg.registry_dir,
            "--plugins-dir",
            cfg.plugins_dir,
            "--cdi-dir",
            cfg.cdi_dir,
            "--boot-id-path",
            cfg.boot_id_path,
            "--kubeconfig",
            str(root / "kubeconfig"),
            "--nats-url",
            nats_server.url,
            "--healthcheck-port",
            str(health_port),
            "--metrics-port",
            str(metrics_port),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=out,
        )
    try:
        yield Preparer(proc, log, health_port, metrics_port, Path(cfg.registry_dir), Path(cfg.plugins_dir))
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(15):
                await proc.wait()


async def check(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await pb2_grpc.HealthStub(channel).Check(pb2.HealthCheckRequest(service=service), timeout=10)
        return int(reply.status)


async def test_grpc_health_serves_only_while_both_plugins_answer_and_readyz_waits_for_registration(
    preparer: Preparer,
) -> None:
    p = preparer
    # ready to be probed once its HTTP endpoint is up; not ready until the kubelet registered both drivers
    text = await wait_for(p.metrics_port, "/readyz", 503, p.proc, p.log, containing="registered")
    assert "gpu.nvidia.com registered with the kubelet" in text
    assert "compute-domain.nvidia.com registered with the kubelet" in text
    for driver in DRIVERS:
        sock = p.registry / f"{driver}-reg.sock"
        async with asyncio.timeout(30):
            while not sock.exists():  # another process's effect
                await asyncio.sleep(0.05)
        await (await register(sock)).close()
    assert await wait_for(p.metrics_port, "/readyz", 200, p.proc, p.log) == "ok\n"

    assert await check(p.health_port) == pb2.HealthCheckResponse.SERVING
    assert await check(p.health_port, "liveness") == pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await check(p.health_port, "gpu.nvidia.com")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    # the probe's empty NodePrepareResources calls are not counted as kubelet requests
    _, metrics = await asyncio.to_thread(get, p.metrics_port, "/metrics")
    assert 'gpu_dra_requests_total{driver="gpu.nvidia.com",operation="prepare"} 0.0' in metrics

    async with grpc.aio.insecure_channel(f"127.0.0.1:{p.health_port}") as channel:
        watch = pb2_grpc.HealthStub(channel).Watch(pb2.HealthCheckRequest(service=""))
        reply = await watch.read()
        assert isinstance(reply, pb2.HealthCheckResponse) and reply.status == pb2.HealthCheckResponse.SERVING
        # the GPU plugin's DRA socket disappears (as if removed under a running process): not serving
        (p.plugins / "gpu.nvidia.com" / "dra.sock").unlink()
        assert await check(p.health_port) == pb2.HealthCheckResponse.NOT_SERVING
        async with asyncio.timeout(15):
            reply = await watch.read()
            assert isinstance(reply, pb2.HealthCheckResponse) and reply.status == pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    assert "gRPC health: not serving" in p.log.read_text()
