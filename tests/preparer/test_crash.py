"""kill -9 of a real `gpu-dra preparer` process between PrepareStarted and PrepareCompleted: the restarted
process rolls the claim back and the device is free. Claims come from the embedded API server, devices
from an in-process simulated discovery, over a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedded.apiserver.testing import running_apiserver
from embedded.harness.discovery import RunningDiscovery, running_discovery
from embedded.kubelet.client import register
from shared.bus import Bus
from shared.events import catalog
from shared.events.claims import ClaimLifecycle
from shared.events.devices import MigCreateReply, MigCreateRequest
from shared.natsserver import EmbeddedNats
from tests.preparer.helpers import ApiClaims, checkpoint, claim_doc, node_config

REPO = Path(__file__).resolve().parents[2]
MIG = "gpu-1-mig-2g20gb-14-2"


async def start_preparer(
    root: Path, kubeconfig: Path, nats_url: str, log_path: Path, *extra: str
) -> asyncio.subprocess.Process:
    cfg = node_config(root)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_")}
    log = open(log_path, "ab")  # noqa: ASYNC230, SIM115 - handed to the child
    try:
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
            str(kubeconfig),
            "--nats-url",
            nats_url,
            "--cleanup-interval",
            "600",
            *extra,
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=log,
        )
    finally:
        log.close()
    return proc


async def wait_for_socket(path: Path, proc: asyncio.subprocess.Process, log_path: Path) -> None:
    async with asyncio.timeout(30):
        while not path.exists():
            assert proc.returncode is None, log_path.read_text()[-3000:]
            await asyncio.sleep(0.05)


class HungMigCreates:
    """Discovery's MIG-create subject taken over: each create is carried out, then not answered until `hang` is
    set (`created` is set by the first); `restore()` has discovery serve creates again."""

    def __init__(self, disc: RunningDiscovery, bus: Bus) -> None:
        self.disc, self.bus = disc, bus
        self.created, self.hang = asyncio.Event(), asyncio.Event()
        self._sub: Any = None

    async def start(self) -> HungMigCreates:
        real = next(s for s in self.disc.service.bus._subs if s.subject == "dra.v1.device.n1.mig-create")
        await real.unsubscribe()

        async def create_then_hang(req: MigCreateRequest) -> MigCreateReply:
            reply = await self.disc.service.ops.mig_create(req)
            assert reply.ok, reply.error
            self.created.set()
            await self.hang.wait()
            return reply

        self._sub = await self.bus.serve(catalog.DEVICE_MIG_CREATE, create_then_hang, node="n1")
        return self

    async def restore(self) -> None:
        self.hang.set()
        await self._sub.unsubscribe()
        await self.bus.serve(catalog.DEVICE_MIG_CREATE, self.disc.service.ops.mig_create, node="n1")


async def prepare_until_created(plugin: Any, claims: list[Any], created: asyncio.Event) -> asyncio.Task[Any]:
    """As the kubelet does: a prepare that fails fast (the preparer's bus not attached yet, so no device operation
    can be asked for) is sent again, until one reaches the MIG create; that prepare, still waiting."""
    async with asyncio.timeout(20):
        while True:
            prepare = asyncio.create_task(plugin.prepare(claims, timeout=30))
            reached = asyncio.create_task(created.wait())
            await asyncio.wait({prepare, reached}, return_when=asyncio.FIRST_COMPLETED)
            if reached.done():
                return prepare
            reached.cancel()
            assert any(r.error for r in prepare.result().values()), "prepared without the MIG create"
            await asyncio.sleep(0.2)


@dataclass
class CrashRig:
    """What a real `gpu-dra preparer` process is run against here: NATS (`bus`), the embedded API server holding
    the claims, in-process discovery on simulated GPUs; its log and registration socket under `root`."""

    root: Path
    nats_url: str
    bus: Bus
    api: Any
    claims: ApiClaims
    disc: RunningDiscovery

    @property
    def log_path(self) -> Path:
        return self.root / "preparer.log"

    @property
    def reg_socket(self) -> Path:
        return self.root / "reg" / "gpu.nvidia.com-reg.sock"

    async def start(self) -> asyncio.subprocess.Process:
        """A preparer process, once its registration socket is up."""
        proc = await start_preparer(self.root, self.api.kubeconfig_path, self.nats_url, self.log_path)
        await wait_for_socket(self.reg_socket, proc, self.log_path)
        return proc

    async def stop(self, proc: asyncio.subprocess.Process) -> None:
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            await proc.wait()


@contextlib.asynccontextmanager
async def crash_rig(root: Path, nats_url: str, name: str, simulate: str) -> AsyncIterator[CrashRig]:
    bus = await Bus.connect(nats_url, name=name)
    await bus.provision()
    try:
        async with (
            running_apiserver(root / "api") as api,
            api.client() as client,
            running_discovery(bus, node="n1", simulate=simulate, root=root / "sim") as disc,
        ):
            yield CrashRig(root, nats_url, bus, api, ApiClaims(client), disc)
    finally:
        await bus.close()


async def test_kill_9_mid_prepare_then_restart_rolls_back_and_frees_the_device(
    root: Path, nats_server: EmbeddedNats
) -> None:
    async with crash_rig(root, nats_server.url, "crash-test", "h100x2") as rig:
        claim = await rig.claims.add(claim_doc(name="dyn", results=[("mig", MIG)]))

        # Take over discovery's MIG-create subject: really create the device, then never answer.
        creates = await HungMigCreates(rig.disc, rig.bus).start()
        proc = await rig.start()
        plugin = await register(rig.reg_socket)
        prepare = await prepare_until_created(plugin, [claim], creates.created)
        assert checkpoint(root)[claim.uid]["state"] == "PrepareStarted"
        assert [m.name for m in rig.disc.inventory.gpus[1].mig_devices] == [MIG]
        proc.send_signal(signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL
        prepare.cancel()
        await plugin.close()

        # Discovery answers normally again; a new preparer process starts on the same node.
        await creates.restore()
        rolled_back: asyncio.Future[ClaimLifecycle] = asyncio.get_running_loop().create_future()

        async def on_rolled_back(event: ClaimLifecycle, _ctx: object) -> None:
            if event.claim_uid == claim.uid and not rolled_back.done():
                rolled_back.set_result(event)

        await rig.bus.subscribe(
            catalog.CLAIM, on_rolled_back, namespace=claim.namespace, node="n1", event="rolled-back"
        )
        proc = await rig.start()
        try:
            try:
                async with asyncio.timeout(20):
                    event = await rolled_back
            except TimeoutError:
                raise AssertionError(f"not rolled back: {rig.log_path.read_text()[-4000:]}") from None
            # the event follows the undo (MIG device destroyed, discovery re-scanned) and the checkpoint write
            assert claim.uid not in checkpoint(root) and rig.disc.inventory.gpus[1].mig_devices == []
            assert event.error and [d.device for d in event.devices] == [MIG]
            # the device is free: the kubelet's retry prepares it from scratch
            plugin = await register(rig.reg_socket)
            result = (await plugin.prepare([claim]))[claim.uid]
            assert result.error == "", result.error
            assert [m.name for m in rig.disc.inventory.gpus[1].mig_devices] == [MIG]
            assert await plugin.unprepare([claim]) == {claim.uid: ""}
            assert rig.disc.inventory.gpus[1].mig_devices == []
            await plugin.close()
        finally:
            await rig.stop(proc)
        assert not rig.reg_socket.exists(), "clean shutdown removes the registration socket"
