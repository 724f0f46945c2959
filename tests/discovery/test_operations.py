"""Device operations over the bus: MIG create/destroy, sharing, MPS; the inventory follows each change."""

from __future__ import annotations

import asyncio

from embedded.harness.discovery import running_discovery
from shared.bus import Bus
from shared.events import catalog
from shared.events.devices import (
    MigCreateRequest,
    MigDestroyRequest,
    MpsStartRequest,
    MpsStopRequest,
    SetSharingRequest,
)
from shared.events.inventory import MigPlacement, NodeInventory


async def inventory_events(bus: Bus, node: str) -> asyncio.Queue[NodeInventory]:
    queue: asyncio.Queue[NodeInventory] = asyncio.Queue()

    async def on_inventory(inv: NodeInventory, ctx: object) -> None:
        await queue.put(inv)

    await bus.subscribe(catalog.INVENTORY, on_inventory, node=node)
    return queue


async def test_mig_create_and_destroy_round_trip(bus, tmp_path):
    async with running_discovery(bus, "n1", "h100x2", tmp_path) as disc:
        events = await inventory_events(bus, "n1")
        gpu = disc.inventory.gpus[0]
        reply = await bus.request(
            catalog.DEVICE_MIG_CREATE,
            MigCreateRequest(gpu_uuid=gpu.uuid, profile="3g.40gb", placement=MigPlacement(start=4, size=4)),
            timeout=10,
            node="n1",
        )
        assert reply.ok, reply.error
        assert reply.device.uuid.startswith("MIG-")
        assert reply.device.name == "gpu-0-mig-3g40gb-9-4"
        after = await asyncio.wait_for(events.get(), 10)
        migs = after.gpus[0].mig_devices
        assert [m.name for m in migs] == ["gpu-0-mig-3g40gb-9-4"] and after.gpus[0].mig_enabled
        assert migs[0].device_path_caps, "MIG devices carry their /dev/nvidia-caps nodes"

        # Idempotent: the same placement again returns the same device and changes nothing.
        again = await bus.request(
            catalog.DEVICE_MIG_CREATE,
            MigCreateRequest(gpu_uuid=gpu.uuid, profile="3g.40gb", placement=MigPlacement(start=4, size=4)),
            timeout=10,
            node="n1",
        )
        assert again.ok and again.device.uuid == reply.device.uuid

        # An overlapping placement is a typed error and no change.
        clash = await bus.request(
            catalog.DEVICE_MIG_CREATE,
            MigCreateRequest(gpu_uuid=gpu.uuid, profile="1g.10gb", placement=MigPlacement(start=5, size=1)),
            timeout=10,
            node="n1",
        )
        assert not clash.ok and clash.error.code == "placement-overlap", clash.error
        assert reply.device.uuid in clash.error.message
        assert [m.name for m in (await disc.rescan()).gpus[0].mig_devices] == ["gpu-0-mig-3g40gb-9-4"]

        bad = await bus.request(
            catalog.DEVICE_MIG_CREATE,
            MigCreateRequest(gpu_uuid=gpu.uuid, profile="5g.50gb", placement=MigPlacement(start=0, size=0)),
            timeout=10,
            node="n1",
        )
        assert not bad.ok and bad.error.code == "invalid-argument" and "1g.10gb" in bad.error.message

        gone = await bus.request(
            catalog.DEVICE_MIG_DESTROY,
            MigDestroyRequest(gpu_uuid=gpu.uuid, mig_uuid=reply.device.uuid),
            timeout=10,
            node="n1",
        )
        assert gone.ok and gone.destroyed
        final = await asyncio.wait_for(events.get(), 10)
        assert final.gpus[0].mig_devices == []
        # Destroying again is not an error: nothing is left to destroy.
        twice = await bus.request(
            catalog.DEVICE_MIG_DESTROY,
            MigDestroyRequest(gpu_uuid=gpu.uuid, mig_uuid=reply.device.uuid),
            timeout=10,
            node="n1",
        )
        assert twice.ok and not twice.destroyed


async def test_sharing_and_mps_change_the_inventory(bus, tmp_path):
    async with running_discovery(bus, "n1", "h100x2", tmp_path) as disc:
        events = await inventory_events(bus, "n1")
        uuids = [g.uuid for g in disc.inventory.gpus]
        reply = await bus.request(
            catalog.DEVICE_SET_SHARING,
            SetSharingRequest(gpu_uuids=uuids[:1], compute_mode="Default", timeslice="Long"),
            timeout=10,
            node="n1",
        )
        assert reply.ok, reply.error
        inv = await asyncio.wait_for(events.get(), 10)
        assert inv.gpus[0].sharing.timeslice == "Long" and inv.gpus[1].sharing.timeslice == "Default"

        started = await bus.request(
            catalog.DEVICE_MPS_START,
            MpsStartRequest(
                daemon_id="claim-1",
                gpu_uuids=uuids,
                active_thread_percentage=50,
                pinned_device_memory_limits={uuids[0]: 10 * 1024**3},
            ),
            timeout=10,
            node="n1",
        )
        assert started.ok, started.error
        assert started.pipe_dir and started.shm_dir
        inv = await asyncio.wait_for(events.get(), 10)
        assert {g.sharing.mps_daemon for g in inv.gpus} == {"claim-1"}
        assert all(g.sharing.compute_mode == "ExclusiveProcess" for g in inv.gpus)

        stopped = await bus.request(catalog.DEVICE_MPS_STOP, MpsStopRequest(daemon_id="claim-1"), timeout=10, node="n1")
        assert stopped.ok
        inv = await asyncio.wait_for(events.get(), 10)
        assert {g.sharing.mps_daemon for g in inv.gpus} == {""}

        unknown = await bus.request(
            catalog.DEVICE_SET_SHARING,
            SetSharingRequest(gpu_uuids=["GPU-nope"], timeslice="Short"),
            timeout=10,
            node="n1",
        )
        assert not unknown.ok and unknown.error.code == "not-found"


async def test_unchanged_inventory_publishes_nothing(bus, tmp_path):
    async with running_discovery(bus, "n1", "h100x2", tmp_path) as disc:
        count = disc.service.publish_count
        await disc.rescan()
        await disc.rescan()
        assert disc.service.publish_count == count
    # A restart with the same machine finds its inventory in KV and publishes nothing new.
    async with running_discovery(bus, "n1", "h100x2", tmp_path) as disc:
        assert disc.service.publish_count == 0
