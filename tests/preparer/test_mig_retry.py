"""A retried prepare of a dynamic MIG claim whose earlier attempt left its MIG device behind: the preparer over its
real socket, discovery in-process on a simulated H100 node, device operations over a real nats-server.

The earlier attempt's create was carried out but never answered (the kubelet gave up on the call), and its
rollback was refused by discovery, so a PrepareStarted entry and a live MIG device of the claim's name are
left when the kubelet calls again. Seen in `tests/nodeagent/test_preparer_restart.py` (after a preparer
restart): the retry took the leftover device for a static one, its rollback then destroyed it, and the claim
was PrepareCompleted on a MIG device discovery no longer had."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from pathlib import Path

import pytest

from embedded.harness.discovery import RunningDiscovery
from services.preparer.host.claimstate import ClaimPreparer
from shared.bus import Bus
from shared.events import catalog
from shared.events.devices import (
    DeviceOpError,
    MigCreateReply,
    MigCreateRequest,
    MigDestroyReply,
    MigDestroyRequest,
)
from tests.preparer.helpers import MemoryClaims, claim_doc, running_node

MIG = "gpu-4-mig-3g40gb-9-4"


def live_migs(disc: RunningDiscovery) -> list[str]:
    return [m.uuid for g in disc.inventory.gpus for m in g.mig_devices]


async def take_over(disc: RunningDiscovery, bus: Bus, entry: catalog.Entry, handler: object) -> None:
    real = next(s for s in disc.service.bus._subs if s.subject == entry.format(node="n1"))
    await real.unsubscribe()
    await bus.serve(entry, handler, node="n1")  # type: ignore[arg-type]


async def test_a_retry_after_a_refused_rollback_prepares_a_mig_device_that_exists(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rollback retry loop (1 s after a failed rollback) would undo the leftover before the kubelet's retry
    # comes: kept out of the way, so the retry is the one that finds it, as after a restart.
    monkeypatch.setattr(
        ClaimPreparer,
        "retry_failed_rollbacks",
        functools.partialmethod(ClaimPreparer.retry_failed_rollbacks, first_delay=600.0),
    )
    created: asyncio.Queue[str] = asyncio.Queue()
    answer = asyncio.Event()  # discovery answers creates only once set
    refusing = True  # discovery refuses destroys (as NVML does for a device in use) while True

    async def create_then_hold(req: MigCreateRequest) -> MigCreateReply:
        reply = await discovery.service.ops.mig_create(req)
        assert reply.ok and reply.device is not None, reply.error
        created.put_nowait(reply.device.uuid)
        await answer.wait()
        return reply

    async def destroy_unless_refusing(req: MigDestroyRequest) -> MigDestroyReply:
        if refusing:
            return MigDestroyReply(ok=False, error=DeviceOpError(code="in-use", message="held for the test"))
        return await discovery.service.ops.mig_destroy(req)

    await take_over(discovery, bus, catalog.DEVICE_MIG_CREATE, create_then_hold)
    await take_over(discovery, bus, catalog.DEVICE_MIG_DESTROY, destroy_unless_refusing)
    claim = claims.add(claim_doc(name="dyn", results=[("mig", MIG)]))
    async with running_node(claims, root, bus=bus) as node:
        preparer = node.service.preparer
        inventory = node.service.plugin.inventory  # type: ignore[attr-defined]
        first = asyncio.create_task(node.plugin.prepare([claim]))
        async with asyncio.timeout(10):
            leftover = await created.get()
        assert await inventory.wait_mig(leftover, present=True)  # the undo sees the device it must destroy
        first.cancel()  # the kubelet gives up on the call: the preparer rolls back, discovery refuses
        async with asyncio.timeout(10):
            await preparer.rollback_failed.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        assert node.service.checkpoint.claims[claim.uid].state == "PrepareStarted"
        assert live_migs(discovery) == [leftover]
        answer.set()
        refusing = False

        result = (await node.plugin.prepare([claim]))[claim.uid]  # the kubelet's retry
        assert result.error == "", result.error
        [dev] = node.service.checkpoint.claims[claim.uid].devices
        assert node.service.checkpoint.claims[claim.uid].state == "PrepareCompleted"
        assert live_migs(discovery) == [dev.uuid], "the prepared claim's MIG device exists"
        assert dev.dynamic_mig and dev.uuid != leftover, "created by this prepare, after the leftover's destroy"

        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}  # and its unprepare still destroys it
        assert live_migs(discovery) == []
