"""Health: injected XIDs become device health events once; ignored XIDs and restarts add none."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from embedded.harness.discovery import running_discovery
from shared.bus import Bus
from shared.events import catalog
from shared.events.devices import InjectXidRequest
from shared.events.health import DeviceHealth


async def health_events(bus: Bus, node: str) -> asyncio.Queue[DeviceHealth]:
    queue: asyncio.Queue[DeviceHealth] = asyncio.Queue()

    async def on_health(event: DeviceHealth, ctx: object) -> None:
        await queue.put(event)

    await bus.subscribe(catalog.HEALTH, on_health, node=node)
    return queue


async def inject(bus: Bus, node: str, uuid: str, xid: int = 0, **flags: bool) -> None:
    reply = await bus.request(
        catalog.DEVICE_INJECT_XID, InjectXidRequest(gpu_uuid=uuid, xid=xid, **flags), timeout=10, node=node
    )
    assert reply.ok, reply.error


async def test_xid_79_is_one_event_xid_13_none_and_restart_repeats_nothing(bus, tmp_path):
    events = await health_events(bus, "n1")
    async with running_discovery(bus, "n1", "h100x4", tmp_path) as disc:
        gpus = disc.inventory.gpus
        await inject(bus, "n1", gpus[0].uuid, 13)  # ignored by default (application error)
        await inject(bus, "n1", gpus[1].uuid, 79)  # fell off the bus
        first = await asyncio.wait_for(events.get(), 10)
        # Events are handled in order, so had XID 13 produced anything it would have come first.
        assert (first.device, first.state, first.reason, first.xid) == ("gpu-1", "Unhealthy", "xid", 79)
        await inject(bus, "n1", gpus[1].uuid, 79)  # a repeat of the same fault: no new event
        await inject(bus, "n1", gpus[2].uuid, 48)
        second = await asyncio.wait_for(events.get(), 10)
        assert (second.device, second.xid) == ("gpu-2", 48)
        stored = await (await bus.kv(catalog.HEALTH_BUCKET)).get("n1.gpu-1")
        assert stored is not None and stored.xid == 79

    async with running_discovery(bus, "n1", "h100x4", tmp_path) as disc:
        await inject(bus, "n1", gpus[3].uuid, 94)
        after_restart = await asyncio.wait_for(events.get(), 10)
        assert after_restart.device == "gpu-3", f"restart replayed {after_restart.device}"
        await inject(bus, "n1", gpus[1].uuid, recover=True)
        healed = await asyncio.wait_for(events.get(), 10)
        assert (healed.device, healed.state) == ("gpu-1", "Healthy")
    assert events.empty()


async def test_ignore_list_is_configurable(bus, tmp_path):
    events = await health_events(bus, "n2")
    async with running_discovery(bus, "n2", "h100x2", tmp_path, additional_xids_to_ignore=[79]) as disc:
        gpus = disc.inventory.gpus
        await inject(bus, "n2", gpus[0].uuid, 79)
        await inject(bus, "n2", gpus[1].uuid, gpu_lost=True)
        lost = await asyncio.wait_for(events.get(), 10)
        assert (lost.device, lost.reason) == ("gpu-1", "gpu-lost")
    assert events.empty()


async def test_mig_device_xid_marks_only_that_device(bus, tmp_path):
    machine = tmp_path / "m.yaml"
    machine.write_text(
        "gpus:\n- profile: h100\n  mig_enabled: true\n  mig_devices:\n"
        "  - {profile: 3g.40gb, placement: 0}\n  - {profile: 3g.40gb, placement: 4}\n"
    )
    events = await health_events(bus, "n3")
    async with running_discovery(bus, "n3", machine=str(machine), root=tmp_path) as disc:
        gpu = disc.inventory.gpus[0]
        await inject(bus, "n3", gpu.uuid, gpu_lost=True)
        names = {(await asyncio.wait_for(events.get(), 10)).device for _ in range(3)}
        assert names == {"gpu-0", "gpu-0-mig-3g40gb-9-0", "gpu-0-mig-3g40gb-9-4"}


def test_inject_xid_cli_reports_an_unreachable_node(nats_server):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shared.cli",
            "discovery",
            "inject-xid",
            "--node",
            "nowhere",
            "--device",
            "gpu-0",
            "--xid",
            "79",
            "--timeout",
            "0.5",
            "--nats-url",
            nats_server.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "no reply on dra.v1.device.nowhere" in done.stderr and "Traceback" not in done.stderr
