"""The kubelet emulator rides out a preparer SIGKILLed in the middle of a pod's NodePrepareResources (seen in
`gpu-dra up --nodes 2`: a pod stayed ContainerCreating for 9 minutes, holding its GPU).

Embedded API server, a real nats-server, simulated discovery in-process, the real `gpu-dra preparer` in a
process of its own, `gpu-dra kubelet`'s run loop in-process. A prepare is held deterministically where the
preparer asks discovery for the claim's MIG device: discovery creates it, then answers only when told."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s

from embedded.apiserver.testing import running_apiserver
from embedded.harness.discovery import RunningDiscovery, running_discovery
from embedded.nodeagent.plugins import PluginRegistry
from embedded.nodeagent.podclaims import EDITS_ANNOTATION
from shared.bus import Bus
from shared.events import catalog
from shared.events.devices import MigCreateReply, MigCreateRequest
from shared.kube.resources import Kube
from shared.natsserver import EmbeddedNats
from tests.nodeagent.test_kubelet import Cluster
from tests.preparer.helpers import ApiClaims, checkpoint, claim_doc, cleanup, short_root
from tests.preparer.test_crash import start_preparer, wait_for_socket
from tests.preparer.test_crash_sharing import start_ready_preparer, stop

MIG = "gpu-1-mig-2g20gb-14-2"
# A real kubelet tries a pod whose prepare failed again at the pod's next sync: every --sync-frequency (1 min),
# jittered up to 1.5x. Once the preparer is back the pod must run well inside that.
RUNNING_WITHIN_S = 15.0


@dataclass
class MigHold:
    """Discovery's MIG create, taken over: it creates the device, then answers once its create is released
    (the n-th create by `release(n)`, every one by `release_all()`)."""

    held: list[MigCreateRequest] = field(default_factory=list)
    arrived: asyncio.Condition = field(default_factory=asyncio.Condition)
    released: dict[int, asyncio.Event] = field(default_factory=dict)
    all_released: bool = False

    def gate(self, n: int) -> asyncio.Event:
        event = self.released.setdefault(n, asyncio.Event())
        if self.all_released:
            event.set()
        return event

    def release(self, n: int) -> None:
        self.gate(n).set()

    def release_all(self) -> None:
        self.all_released = True
        for event in self.released.values():
            event.set()

    async def until_held(self, count: int, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout), self.arrived:
            await self.arrived.wait_for(lambda: len(self.held) >= count)


@dataclass
class Parts:
    root: Path
    bus: Bus
    api: Any
    cluster: Cluster
    disc: RunningDiscovery
    hold: MigHold

    async def preparer(self, nats_server: EmbeddedNats, *, ready: bool) -> asyncio.subprocess.Process:
        if ready:  # has discovery's inventory: the kubelet's first call reaches the MIG create
            return await start_ready_preparer(self.root, self.api, nats_server)
        log_path = self.root / "preparer.log"
        proc = await start_preparer(self.root, self.api.kubeconfig_path, nats_server.url, log_path)
        await wait_for_socket(self.root / "reg" / "gpu.nvidia.com-reg.sock", proc, log_path)
        return proc

    async def running_soon(self, name: str) -> dict[str, Any]:
        try:
            pod: dict[str, Any] = await asyncio.wait_for(self.cluster.running(name), RUNNING_WITHIN_S)
            return pod
        except (TimeoutError, AssertionError):
            now = await self.cluster.pod(name)
            log = (self.root / "preparer.log").read_text()[-3000:]
            raise AssertionError(
                f"pod {name} not Running within {RUNNING_WITHIN_S} s: {json.dumps((now or {}).get('status'))}\n{log}"
            ) from None

    def mig_devices(self) -> list[str]:
        return [m.name for g in self.disc.inventory.gpus for m in g.mig_devices]

    async def assert_prepared_once(self, running: dict[str, Any], claim_uid: str) -> None:
        """What the pod got is the MIG device; the node holds the claim once and that one device (no GPU leaked)."""
        edits = json.loads(running["metadata"]["annotations"][EDITS_ANNOTATION])
        assert edits["main"]["devices"] == [f"n1/{MIG}"]
        assert list(checkpoint(self.root)) == [claim_uid]
        assert checkpoint(self.root)[claim_uid]["state"] == "PrepareCompleted"
        # the one MIG device discovery holds is the one the claim was prepared on, created by its own prepare
        # (a retry that planned before rolling back the cut-off attempt took that attempt's device for a static
        # one, which the rollback then destroyed: the claim was PrepareCompleted on a device that was gone)
        [dev] = checkpoint(self.root)[claim_uid]["devices"]
        assert [(m.name, m.uuid) for g in self.disc.inventory.gpus for m in g.mig_devices] == [(MIG, dev["uuid"])]
        assert dev["dynamic_mig"]

    async def delete_and_check_freed(self, name: str, claim_uid: str) -> None:
        await self.cluster.core.delete_namespaced_pod(name, "default")
        await self.cluster.gone(name)
        async with asyncio.timeout(15):
            while claim_uid in checkpoint(self.root) or self.mig_devices():
                await asyncio.sleep(0.05)


@pytest.fixture
async def parts(nats_server: EmbeddedNats) -> AsyncIterator[Parts]:
    root = short_root()
    bus = await Bus.connect(nats_server.url, name="preparer-restart-test")
    await bus.provision()
    try:
        async with (
            running_apiserver(root / "api") as api,
            api.client() as client,
            running_discovery(bus, node="n1", simulate="h100x2", root=root / "sim") as disc,
        ):
            hold = await hold_mig_creates(bus, disc)
            cluster = Cluster(root, api, client, k8s.CoreV1Api(client), Kube(client), ApiClaims(client), node=None)  # type: ignore[arg-type]  # the preparer is a process here
            cluster.start_kubelet()
            try:
                yield Parts(root, bus, api, cluster, disc, hold)
            finally:
                hold.release_all()
                await cluster.stop_kubelet()
    finally:
        await bus.close()
        cleanup(root)


async def hold_mig_creates(bus: Bus, disc: RunningDiscovery) -> MigHold:
    real = next(s for s in disc.service.bus._subs if s.subject == "dra.v1.device.n1.mig-create")
    await real.unsubscribe()
    hold = MigHold()

    async def create_then_hold(req: MigCreateRequest) -> MigCreateReply:
        reply = await disc.service.ops.mig_create(req)
        assert reply.ok, reply.error
        async with hold.arrived:
            hold.held.append(req)
            hold.arrived.notify_all()
            n = len(hold.held)
        await hold.gate(n).wait()
        return reply

    await bus.serve(catalog.DEVICE_MIG_CREATE, create_then_hold, node="n1")
    return hold


async def kill_9(proc: asyncio.subprocess.Process) -> None:
    proc.send_signal(signal.SIGKILL)
    assert await proc.wait() == -signal.SIGKILL


async def start_pod_and_hold_its_prepare(
    parts: Parts, nats_server: EmbeddedNats
) -> tuple[Any, asyncio.subprocess.Process]:
    claim = await parts.cluster.claims.add(claim_doc(name="mig", results=[("gpu", MIG)]))
    proc = await parts.preparer(nats_server, ready=True)
    try:
        pod = await parts.cluster.create_pod("mig", claim.name, ["main"])
        await parts.cluster.reserve(claim, pod)
        await parts.hold.until_held(1)  # the kubelet's NodePrepareResources is in flight; the device exists
        assert checkpoint(parts.root)[claim.uid]["state"] == "PrepareStarted"
        assert parts.mig_devices() == [MIG]
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
    return claim, proc


async def test_a_prepare_cut_off_by_the_kill_is_retried_and_the_pod_runs_with_its_claim_prepared_once(
    parts: Parts, nats_server: EmbeddedNats
) -> None:
    claim, proc = await start_pod_and_hold_its_prepare(parts, nats_server)
    await kill_9(proc)  # the call's connection breaks: the kubelet's NodePrepareResources fails
    parts.hold.release_all()
    proc = await parts.preparer(nats_server, ready=False)  # as its DaemonSet pod would: back, rolls the claim back
    try:
        running = await parts.running_soon("mig")
        await parts.assert_prepared_once(running, claim.uid)
        await parts.delete_and_check_freed("mig", claim.uid)
    finally:
        await stop(proc)


async def test_a_prepare_in_flight_when_the_plugin_registers_again_is_retried_at_once(
    parts: Parts, nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet's channel to the old registration reconnects to the restarted preparer's socket and a retried
    prepare is in flight on it when the kubelet's watcher notices the new registration and drops the old one
    (a window of one scan; held open here): that call ends under the kubelet, which must try again at once
    through the new registration, not stop retrying waiting pods altogether."""
    watching = asyncio.Event()
    watching.set()
    rescanned = asyncio.Event()
    scan = PluginRegistry.scan

    async def gated_scan(self: PluginRegistry) -> None:
        await watching.wait()
        await scan(self)
        rescanned.set()

    monkeypatch.setattr(PluginRegistry, "scan", gated_scan)
    claim, proc = await start_pod_and_hold_its_prepare(parts, nats_server)
    watching.clear()  # the kubelet's watcher has not seen the restart yet
    await kill_9(proc)
    parts.hold.release(1)  # discovery answers the killed preparer (nobody listens) and takes the next create
    proc = await parts.preparer(nats_server, ready=False)
    try:
        # The kubelet's retries go through the old registration's channel, which reconnects to the new socket.
        await parts.hold.until_held(2)
        rescanned.clear()
        watching.set()  # the watcher sees the new registration: the old plugin and its call in flight go
        async with asyncio.timeout(5):
            await rescanned.wait()
        parts.hold.release_all()
        running = await parts.running_soon("mig")
        await parts.assert_prepared_once(running, claim.uid)
        await parts.delete_and_check_freed("mig", claim.uid)
    finally:
        await stop(proc)
