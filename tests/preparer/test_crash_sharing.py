"""kill -9 of a real `gpu-dra preparer` process in the middle of a time-slice or MPS prepare: after the
restart no policy is left on the GPU and no MPS daemon runs. Claims from the embedded API server,
discovery in-process on simulated GPUs running a fake driver root's binaries, a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from embedded.apiserver.testing import running_apiserver
from embedded.harness.discovery import RunningDiscovery, running_discovery
from embedded.kubelet.client import PluginError, register
from shared.bus import Bus
from shared.events import catalog
from shared.events.claims import ClaimLifecycle
from shared.events.devices import MpsStartReply, MpsStartRequest
from shared.natsserver import EmbeddedNats
from tests.fakedriver import FakeDriver, make_driver_root
from tests.polling import wait_gone
from tests.preparer.helpers import ApiClaims, checkpoint, claim_doc, gpu_config
from tests.preparer.test_crash import start_preparer, wait_for_socket


@contextlib.asynccontextmanager
async def node_parts(
    root: Path, nats_server: EmbeddedNats, *, tool_timeout: float = 2.0
) -> AsyncIterator[tuple[Bus, Any, ApiClaims, RunningDiscovery, FakeDriver]]:
    fake = make_driver_root(root / "driver")
    bus = await Bus.connect(nats_server.url, name="crash-sharing-test")
    await bus.provision()
    try:
        async with (
            running_apiserver(root / "api") as api,
            api.client() as client,
            running_discovery(
                bus,
                node="n1",
                simulate="h100x2",
                root=root / "sim",
                driver_root=str(fake.root),
                tool_timeout=tool_timeout,
            ) as disc,
        ):
            yield bus, api, ApiClaims(client), disc, fake
    finally:
        await bus.close()


async def start_ready_preparer(
    root: Path, api: Any, nats_server: EmbeddedNats, *extra: str
) -> asyncio.subprocess.Process:
    """A preparer process that has discovery's inventory (it caches it on disk when it arrives): a claim
    sent earlier would fail on an unknown device, and the kill would land nowhere. A restarted preparer
    would find the previous one's cache at once: it goes first, so the file's return means the bus is up."""
    log_path = root / "preparer.log"
    (root / "plugins" / "gpu.nvidia.com" / "inventory-cache.json").unlink(missing_ok=True)
    proc = await start_preparer(root, api.kubeconfig_path, nats_server.url, log_path, *extra)
    await wait_for_socket(root / "reg" / "gpu.nvidia.com-reg.sock", proc, log_path)
    await wait_for_socket(root / "plugins" / "gpu.nvidia.com" / "inventory-cache.json", proc, log_path)
    return proc


async def rolled_back_future(bus: Bus, uid: str, namespace: str) -> asyncio.Future[ClaimLifecycle]:
    done: asyncio.Future[ClaimLifecycle] = asyncio.get_running_loop().create_future()

    async def on_event(event: ClaimLifecycle, _ctx: object) -> None:
        if event.claim_uid == uid and not done.done():
            done.set_result(event)

    await bus.subscribe(catalog.CLAIM, on_event, namespace=namespace, node="n1", event="rolled-back")
    return done


async def kill_9(proc: asyncio.subprocess.Process, prepare: asyncio.Task[Any], plugin: Any) -> None:
    proc.send_signal(signal.SIGKILL)
    assert await proc.wait() == -signal.SIGKILL
    prepare.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await prepare
    await plugin.close()


async def restart_and_wait_rollback(
    root: Path, api: Any, nats_server: EmbeddedNats, rolled_back: asyncio.Future[ClaimLifecycle]
) -> asyncio.subprocess.Process:
    log_path = root / "preparer.log"
    proc = await start_preparer(root, api.kubeconfig_path, nats_server.url, log_path)
    await wait_for_socket(root / "reg" / "gpu.nvidia.com-reg.sock", proc, log_path)
    try:
        async with asyncio.timeout(30):
            await rolled_back
    except TimeoutError:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        raise AssertionError(f"not rolled back: {log_path.read_text()[-4000:]}") from None
    return proc


async def stop(proc: asyncio.subprocess.Process) -> None:
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(15):
        await proc.wait()


async def test_kill_9_during_the_timeslice_call_leaves_no_policy_after_restart(
    root: Path, nats_server: EmbeddedNats
) -> None:
    async with node_parts(root, nats_server) as (bus, api, claims, disc, fake):
        uuid = disc.inventory.gpus[0].uuid
        claim = await claims.add(
            claim_doc(
                name="ts",
                results=[("gpu", "gpu-0")],
                configs=[gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})],
            )
        )
        fake.hang("nvidia-smi")  # the kill lands while nvidia-smi runs
        proc = await start_ready_preparer(root, api, nats_server)
        plugin = await register(root / "reg" / "gpu.nvidia.com-reg.sock")
        prepare = asyncio.create_task(plugin.prepare([claim], timeout=30))
        async with asyncio.timeout(20):
            while not fake.calls("nvidia-smi"):  # the stub's own record: another process's effect
                await asyncio.sleep(0.05)
        [hung] = fake.calls("nvidia-smi")
        assert hung["argv"] == ["compute-policy", "-i", uuid, "--set-timeslice", "3"]
        record = checkpoint(root)[claim.uid]
        assert record["state"] == "PrepareStarted" and record["timesliced_gpus"] == [uuid], "recorded before"
        await kill_9(proc, prepare, plugin)
        fake.heal("nvidia-smi")

        rolled_back = await rolled_back_future(bus, claim.uid, claim.namespace)
        proc = await restart_and_wait_rollback(root, api, nats_server, rolled_back)
        try:
            assert claim.uid not in checkpoint(root)
            assert wait_gone(hung["pid"]), "discovery killed the hung nvidia-smi at its timeout"
            assert [c["argv"][-1] for c in fake.calls("nvidia-smi")] == ["3", "0"]
            assert fake.calls("nvidia-smi")[-1]["argv"][2] == uuid
            assert fake.timeslice(uuid) == "0"
            assert disc.inventory.gpus[0].sharing.timeslice == "Default"
        finally:
            await stop(proc)


async def test_a_prepare_abandoned_by_the_kubelet_is_rolled_back_at_once(root: Path, nats_server: EmbeddedNats) -> None:
    """The kubelet's deadline passes while the time-slice call still runs: the preparer finishes that step
    (discovery kills the hung nvidia-smi at its timeout), resets the GPU and drops the PrepareStarted entry
    on its own path (its event says "abandoned"; a failed rollback's retry or the 10-minute sweep says otherwise),
    seconds after the cancellation; the next claim gets the GPU at Default."""
    async with node_parts(root, nats_server, tool_timeout=1.5) as (bus, api, claims, disc, fake):
        uuid = disc.inventory.gpus[0].uuid
        claim = await claims.add(
            claim_doc(
                name="ts",
                results=[("gpu", "gpu-0")],
                configs=[gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})],
            )
        )
        rolled_back = await rolled_back_future(bus, claim.uid, claim.namespace)
        fake.hang("nvidia-smi")
        proc = await start_ready_preparer(root, api, nats_server)
        plugin = await register(root / "reg" / "gpu.nvidia.com-reg.sock")
        try:
            prepare = asyncio.create_task(plugin.prepare([claim], timeout=1.0))
            async with asyncio.timeout(5):
                while not fake.calls("nvidia-smi"):  # the stub's own record: another process's effect
                    await asyncio.sleep(0.02)
            fake.heal("nvidia-smi")  # the hung call stays hung; the reset after it runs normally
            try:
                await prepare
                raise AssertionError("the prepare finished before the kubelet's deadline")
            except PluginError as exc:
                assert "DEADLINE_EXCEEDED" in str(exc)
            async with asyncio.timeout(10.0):  # a bound on a loaded machine, not a figure: the reason tells the path
                event = await rolled_back
            assert "abandoned" in event.error
            assert claim.uid not in checkpoint(root)
            assert [c["argv"][-1] for c in fake.calls("nvidia-smi")] == ["3", "0"]
            assert fake.timeslice(uuid) == "0"

            plain = await claims.add(claim_doc(name="next", results=[("gpu", "gpu-0")]))
            prepared = await plugin.prepare([plain], timeout=10)
            assert not prepared[plain.uid].error, prepared[plain.uid].error
            assert checkpoint(root)[plain.uid]["timesliced_gpus"] == []
            assert fake.timeslice(uuid) == "0"
        finally:
            await plugin.close()
            await stop(proc)


async def test_a_time_slice_call_past_the_device_op_deadline_is_undone_within_seconds(
    root: Path, nats_server: EmbeddedNats
) -> None:
    """nvidia-smi hangs past the preparer's device-op deadline (1 s), and the reset the rollback asks for
    waits behind it in discovery and times out too. The failed rollback is retried within seconds, not
    at the 10-minute sweep: the GPU ends at Default and the entry is gone."""
    async with node_parts(root, nats_server, tool_timeout=3.0) as (bus, api, claims, disc, fake):
        uuid = disc.inventory.gpus[0].uuid
        claim = await claims.add(
            claim_doc(
                name="ts",
                results=[("gpu", "gpu-0")],
                configs=[gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})],
            )
        )
        rolled_back = await rolled_back_future(bus, claim.uid, claim.namespace)
        fake.hang("nvidia-smi")
        proc = await start_ready_preparer(root, api, nats_server, "--device-op-timeout", "1")
        plugin = await register(root / "reg" / "gpu.nvidia.com-reg.sock")
        try:
            prepare = asyncio.create_task(plugin.prepare([claim], timeout=30))
            async with asyncio.timeout(5):
                while not fake.calls("nvidia-smi"):
                    await asyncio.sleep(0.02)
            fake.heal("nvidia-smi")  # the hung call stays hung until discovery's 3 s tool timeout
            result = (await prepare)[claim.uid]
            assert "rollback" in result.error and "time-slice" in result.error, result.error
            assert checkpoint(root)[claim.uid]["state"] == "PrepareStarted"  # the undo failed: still recorded
            async with asyncio.timeout(5):
                await rolled_back
            assert claim.uid not in checkpoint(root)
            assert fake.calls("nvidia-smi")[-1]["argv"][-1] == "0"
            assert fake.timeslice(uuid) == "0"
        finally:
            await plugin.close()
            await stop(proc)


async def test_kill_9_after_the_mps_daemon_started_leaves_no_daemon_after_restart(
    root: Path, nats_server: EmbeddedNats
) -> None:
    async with node_parts(root, nats_server) as (bus, api, claims, disc, fake):
        claim = await claims.add(
            claim_doc(
                name="mps",
                results=[("gpu", "gpu-1")],
                configs=[gpu_config({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 40}})],
            )
        )
        # Take over discovery's MPS-start subject: really start the daemon, then never answer.
        real_sub = next(s for s in disc.service.bus._subs if s.subject == "dra.v1.device.n1.mps-start")
        await real_sub.unsubscribe()
        started: asyncio.Future[MpsStartReply] = asyncio.get_running_loop().create_future()
        hang = asyncio.Event()

        async def start_then_hang(req: MpsStartRequest) -> MpsStartReply:
            reply = await disc.service.ops.mps_start(req)
            started.set_result(reply)
            await hang.wait()
            return reply

        hijack = await bus.serve(catalog.DEVICE_MPS_START, start_then_hang, node="n1")
        proc = await start_ready_preparer(root, api, nats_server)
        plugin = await register(root / "reg" / "gpu.nvidia.com-reg.sock")
        prepare = asyncio.create_task(plugin.prepare([claim], timeout=30))
        async with asyncio.timeout(20):
            reply = await started
        assert reply.ok, reply.error
        pipe = Path(reply.pipe_dir)
        pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
        record = checkpoint(root)[claim.uid]
        assert record["state"] == "PrepareStarted" and record["mps_daemon_id"] == pipe.parent.name
        await kill_9(proc, prepare, plugin)
        hang.set()
        await hijack.unsubscribe()
        await bus.serve(catalog.DEVICE_MPS_START, disc.service.ops.mps_start, node="n1")
        assert not wait_gone(pid, timeout=0.2), "the daemon outlives the preparer's crash"

        rolled_back = await rolled_back_future(bus, claim.uid, claim.namespace)
        proc = await restart_and_wait_rollback(root, api, nats_server, rolled_back)
        try:
            assert claim.uid not in checkpoint(root)
            assert fake.calls("nvidia-cuda-mps-control")[-1]["stdin"] == "quit\n"
            assert wait_gone(pid), "the rollback stopped the daemon"
            assert not pipe.parent.exists()
            assert disc.inventory.gpus[1].sharing.mps_daemon == ""
            assert disc.inventory.gpus[1].sharing.compute_mode == "Default"
        finally:
            await stop(proc)
