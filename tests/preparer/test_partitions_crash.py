"""kill -9 of a real `gpu-dra preparer` process between a partition's activation request and the claim's
PrepareCompleted: after the restart the partition is in one state (inactive, the claim rolled back) and
no activation is left behind. Claims from the embedded API server, discovery in-process on a simulated
HGX board whose Fabric Manager is the fake driver root's `fmpm`, a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from embedded.apiserver.testing import running_apiserver
from embedded.harness.discovery import running_discovery
from embedded.kubelet.client import register
from shared.bus import Bus
from shared.natsserver import EmbeddedNats
from tests.fabricmanager import fake_fabric_manager
from tests.fakedriver import FakeDriver
from tests.polling import wait_gone
from tests.preparer.helpers import ApiClaims, checkpoint, claim_doc, gpu_config
from tests.preparer.test_crash_sharing import (
    kill_9,
    restart_and_wait_rollback,
    rolled_back_future,
    start_ready_preparer,
    stop,
)


@contextlib.asynccontextmanager
async def hgx_node(root: Path, nats_server: EmbeddedNats) -> AsyncIterator[tuple[Bus, Any, ApiClaims, FakeDriver]]:
    fake = await fake_fabric_manager(root)
    bus = await Bus.connect(nats_server.url, name="partitions-crash-test")
    await bus.provision()
    try:
        async with (
            running_apiserver(root / "api") as api,
            api.client() as client,
            running_discovery(
                bus,
                node="n1",
                simulate="h100x8",
                root=root / "sim",
                driver_root=str(fake.root),
                tool_timeout=2.0,
                fabric_manager_partitions=True,
            ),
        ):
            yield bus, api, ApiClaims(client), fake
    finally:
        await bus.close()


def changes(fake: FakeDriver) -> list[list[str]]:
    return [c["argv"][:2] for c in fake.calls("fmpm") if c["argv"][0] in ("-a", "-d")]


async def wait_call(fake: FakeDriver, flag: str, binary: str = "fmpm") -> dict[str, Any]:
    async with asyncio.timeout(20):
        while True:  # the stub's own record: another process's effect, no event to await
            calls = [c for c in fake.calls(binary) if flag in c["argv"]]
            if calls:
                return calls[0]
            await asyncio.sleep(0.05)


async def kill_and_restart(
    root: Path,
    nats_server: EmbeddedNats,
    bus: Bus,
    api: Any,
    claim: Any,
    fake: FakeDriver,
    hung: str,
    running: tuple[asyncio.subprocess.Process, asyncio.Task[Any], Any],
) -> asyncio.subprocess.Process:
    """kill -9 the preparer mid-prepare, let the `hung` stub go, restart it: the new process once it has
    rolled the claim back."""
    await kill_9(*running)
    fake.heal(hung)
    rolled_back = await rolled_back_future(bus, claim.uid, claim.namespace)
    return await restart_and_wait_rollback(root, api, nats_server, rolled_back)


async def test_kill_9_during_the_activation_call_leaves_the_partition_inactive(
    root: Path, nats_server: EmbeddedNats
) -> None:
    async with hgx_node(root, nats_server) as (bus, api, claims, fake):
        claim = await claims.add(claim_doc(name="pair", results=[("gpus", "gpu-6"), ("gpus", "gpu-7")]))
        fake.hang("fmpm", when="-a")  # the kill lands while Fabric Manager is being asked
        proc = await start_ready_preparer(root, api, nats_server)
        plugin = await register(root / "reg" / "gpu.nvidia.com-reg.sock")
        prepare = asyncio.create_task(plugin.prepare([claim], timeout=30))
        hung = await wait_call(fake, "-a")
        assert hung["argv"][:2] == ["-a", "6"]
        record = checkpoint(root)[claim.uid]
        assert record["state"] == "PrepareStarted" and record["fabric_partition"] == 6, "recorded before"
        proc = await kill_and_restart(root, nats_server, bus, api, claim, fake, "fmpm", (proc, prepare, plugin))
        try:
            assert claim.uid not in checkpoint(root)
            assert wait_gone(hung["pid"]), "discovery killed the hung fmpm at its timeout"
            assert fake.active_partitions() == []
            assert changes(fake) == [["-a", "6"]], "never activated: nothing to deactivate"
        finally:
            await stop(proc)


async def test_kill_9_after_the_activation_deactivates_it_after_restart(root: Path, nats_server: EmbeddedNats) -> None:
    async with hgx_node(root, nats_server) as (bus, api, claims, fake):
        claim = await claims.add(
            claim_doc(
                name="pair",
                results=[("gpus", "gpu-4"), ("gpus", "gpu-5")],
                configs=[gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})],
            )
        )
        fake.hang("nvidia-smi")  # activated; the kill lands in the time-slice step after it
        proc = await start_ready_preparer(root, api, nats_server)
        plugin = await register(root / "reg" / "gpu.nvidia.com-reg.sock")
        prepare = asyncio.create_task(plugin.prepare([claim], timeout=30))
        await wait_call(fake, "--set-timeslice", "nvidia-smi")
        assert fake.active_partitions() == [5] and checkpoint(root)[claim.uid]["state"] == "PrepareStarted"
        proc = await kill_and_restart(root, nats_server, bus, api, claim, fake, "nvidia-smi", (proc, prepare, plugin))
        try:
            assert claim.uid not in checkpoint(root)
            assert fake.active_partitions() == []
            assert changes(fake) == [["-a", "5"], ["-d", "5"]]
            again = await register(root / "reg" / "gpu.nvidia.com-reg.sock")
            try:
                assert (await again.prepare([claim], timeout=30))[claim.uid].error == ""
                assert fake.active_partitions() == [5] and changes(fake)[-1] == ["-a", "5"]
            finally:
                await again.close()
        finally:
            await stop(proc)
