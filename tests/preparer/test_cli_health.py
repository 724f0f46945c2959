"""The `gpu-dra preparer` command line, the v1beta1 service, and the DRAResourceHealth stream."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from embedded.harness.discovery import RunningDiscovery
from embedded.kubelet.client import register
from services.preparer.config import ConfigError, parse
from services.preparer.gpu.healthwatch import HealthWatch
from services.preparer.protos import dra_health_v1alpha1_pb2 as health_pb2
from services.preparer.protos import dra_health_v1alpha1_pb2_grpc as health_grpc
from shared.bus import Bus, BusError
from shared.events import catalog
from shared.events.devices import InjectXidRequest
from shared.events.health import DeviceHealth
from shared.natsserver import EmbeddedNats
from tests.preparer.helpers import MemoryClaims, claim_doc, running_node

REPO = Path(__file__).resolve().parents[2]


def test_settings_from_flags_and_env() -> None:
    cfg = parse(["--node", "n7", "--cdi-dir", "/tmp/cdi"], env={"GPU_DRA_CLEANUP_INTERVAL": "30"})
    assert (cfg.node, cfg.cdi_dir, cfg.cleanup_interval) == ("n7", "/tmp/cdi", 30.0)
    assert cfg.drivers == ["gpu.nvidia.com", "compute-domain.nvidia.com"]  # both, each on its own sockets
    assert parse(["--drivers", "compute-domain.nvidia.com"]).drivers == ["compute-domain.nvidia.com"]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--cleanup-interval", "soon"], {}, "--cleanup-interval"),
        ([], {"GPU_DRA_CDI_ROOT": "/x"}, "unknown setting(s) GPU_DRA_CDI_ROOT"),
        (["--plugins-dir", "relative/dir"], {}, "--plugins-dir must be an absolute path"),
        (["--drivers", "gpu.nvidia.com,tpu.example.com"], {}, "--drivers must name each of"),
    ],
)
def test_bad_settings_name_the_setting(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(argv, env=env)


def test_the_command_exits_2_on_a_bad_setting_and_changes_nothing(root: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "shared.cli", "preparer", "--cleanup-interval", "-1", "--plugins-dir", str(root / "p")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 2
    assert "--cleanup-interval" in run.stderr
    assert not (root / "p").exists()


async def test_v1beta1_prepare_matches_v1(claims: MemoryClaims, root: Path) -> None:
    (root / "host" / "dev").mkdir(parents=True)
    (root / "host" / "dev" / "nvidia2").touch()
    claim = claims.add(claim_doc(name="beta", results=[("gpu", "gpu-2")]))
    async with running_node(claims, root, dev_root=str(root / "host")) as node:
        beta = await register(node.service.registration_socket, known={"v1beta1.DRAPlugin": "v1beta1"})
        try:
            via_beta = (await beta.prepare([claim]))[claim.uid]
        finally:
            await beta.close()
        via_v1 = (await node.plugin.prepare([claim]))[claim.uid]
        assert via_beta == via_v1 and via_beta.devices[0].device == "gpu-2"
        assert json.loads((node.cdi_dir / node.cdi_files()[0]).read_text())["devices"][0]["name"].endswith("gpu-2")


async def test_health_stream_reports_every_device_and_follows_xids(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    async with running_node(claims, root, bus=bus) as node:
        async with grpc.aio.insecure_channel(f"unix:{node.service.dra_socket}") as channel:
            stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                health_pb2.NodeWatchResourcesRequest()
            )
            first = await stream.read()
            assert isinstance(first, health_pb2.NodeWatchResourcesResponse), first  # not the end of the stream
            assert {d.device.device_name for d in first.devices} == {f"gpu-{i}" for i in range(8)}
            assert all(d.health == health_pb2.HEALTHY and d.device.pool_name == "n1" for d in first.devices)
            reply = await bus.request(catalog.DEVICE_INJECT_XID, InjectXidRequest(gpu_uuid="gpu-4", xid=79), node="n1")
            assert reply.ok, reply.error
            async with asyncio.timeout(10):
                while True:
                    update = await stream.read()
                    assert isinstance(update, health_pb2.NodeWatchResourcesResponse), update
                    states = {d.device.device_name: d.health for d in update.devices}
                    if states["gpu-4"] == health_pb2.UNHEALTHY:
                        break
            assert len(update.devices) == 8
            assert states["gpu-3"] == health_pb2.HEALTHY
            stream.cancel()


async def test_health_missed_while_nats_was_away_is_read_from_kv_on_reconnect(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery, nats_server: EmbeddedNats
) -> None:
    """The health subscription is core NATS: an event published while the connection is away never
    arrives. After a reconnect the preparer re-reads KV, and its stream says so without waiting."""
    async with running_node(claims, root, bus=bus) as node:
        async with grpc.aio.insecure_channel(f"unix:{node.service.dra_socket}") as channel:
            stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                health_pb2.NodeWatchResourcesRequest()
            )
            first = await stream.read()
            assert isinstance(first, health_pb2.NodeWatchResourcesResponse), first
            assert all(d.health == health_pb2.HEALTHY for d in first.devices)
            # the last value discovery wrote, whose event the preparer did not hear
            kv = await bus.kv(catalog.HEALTH_BUCKET)
            await kv.put(
                "n1.gpu-5",
                DeviceHealth(
                    node="n1",
                    device="gpu-5",
                    state="Unhealthy",
                    reason="xid",
                    xid=79,
                    message="XID 79: GPU has fallen off the bus",
                ),
            )
            await nats_server.restart()
            async with asyncio.timeout(8):  # under the 10 s resend: the re-read wakes the stream
                while True:
                    update = await stream.read()
                    assert isinstance(update, health_pb2.NodeWatchResourcesResponse), update
                    if {d.device.device_name: d.health for d in update.devices}["gpu-5"] == health_pb2.UNHEALTHY:
                        break
            stream.cancel()


async def test_a_kv_reread_that_fails_after_a_reconnect_is_retried_until_it_reads(bus: Bus) -> None:
    """Right after a NATS restart the bucket may not be served yet: the re-read is retried (one at a time),
    since what was missed while NATS was away is only in KV."""
    kv = await bus.kv(catalog.HEALTH_BUCKET)
    await kv.put("n9.gpu-1", DeviceHealth(node="n9", device="gpu-1", state="Unhealthy", reason="xid", xid=79))

    class NotServedYet:  # the bucket refuses its first read, as a server still recovering its streams would
        reads = 0

        async def items(self, pattern: str) -> dict[str, DeviceHealth]:
            self.reads += 1
            if self.reads == 1:
                raise BusError("KV keys of dra-health failed: JetStream not ready")
            return await kv.items(pattern)

    watch = HealthWatch("n9", inventory=None)  # type: ignore[arg-type]  # the re-read needs no inventory
    changed, flaky = watch.changed, NotServedYet()
    watch._reread(bus, flaky)
    first = watch._rereading
    watch._reread(bus, flaky)  # a second reconnect while the first re-read runs: still one re-read
    assert watch._rereading is first
    await asyncio.wait_for(changed.wait(), 10)
    assert watch.states["gpu-1"].state == "Unhealthy" and flaky.reads == 2
