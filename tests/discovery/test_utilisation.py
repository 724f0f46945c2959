"""Utilisation telemetry: discovery samples every device at the set rate and publishes one message per node
per interval on core NATS; the simulated GPUs turn busy while a claim holds them (claim lifecycle events)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from embedded.harness.discovery import running_discovery
from services.discovery.config import ConfigError, parse
from shared.bus import Bus
from shared.events import catalog
from shared.events.claims import ClaimLifecycle, PreparedDeviceRef
from shared.events.telemetry import DeviceSample, NodeTelemetry

WAIT_S = 10.0


async def telemetry(bus: Bus, node: str) -> asyncio.Queue[NodeTelemetry]:
    queue: asyncio.Queue[NodeTelemetry] = asyncio.Queue()

    async def on_sample(message: NodeTelemetry, ctx: object) -> None:
        await queue.put(message)

    await bus.subscribe(catalog.TELEMETRY, on_sample, node=node)
    return queue


async def until(queue: asyncio.Queue[NodeTelemetry], ok: Callable[[dict[str, DeviceSample]], bool]) -> NodeTelemetry:
    """The first message whose devices (by name) satisfy `ok`."""
    async with asyncio.timeout(WAIT_S):
        while True:
            message = await queue.get()
            if ok({d.device: d for d in message.devices}):
                return message


async def claim_event(bus: Bus, node: str, event: str, uuid: str, device: str) -> None:
    await bus.publish(
        catalog.CLAIM,
        ClaimLifecycle(
            event=event,  # type: ignore[arg-type]
            node=node,
            driver="gpu.nvidia.com",
            claim_uid="uid-1",
            claim_namespace="team-a",
            claim_name="train",
            event_id=f"{node}/uid-1/1/{event}",
            devices=[PreparedDeviceRef(request="gpu", pool=node, device=device, uuid=uuid)],
        ),
        msg_id=f"{node}/uid-1/1/{event}",
        namespace="team-a",
        node=node,
        event=event,
    )


async def test_one_message_per_node_per_interval_with_every_device(bus: Bus, tmp_path: Path) -> None:
    queue = await telemetry(bus, "n1")
    async with running_discovery(bus, "n1", "h100x4", tmp_path, telemetry_interval=0.25) as disc:
        got = [await asyncio.wait_for(queue.get(), WAIT_S) for _ in range(6)]
        sampler = disc.service.sampler
        assert sampler is not None
    for message in got:
        assert message.node == "n1" and message.interval_s == 0.25
        assert [d.device for d in message.devices] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
        for d in message.devices:
            assert d.uuid and d.memory_total_bytes == 80 << 30
            assert d.sm_percent is not None and d.power_mw is not None and d.temperature_c is not None
    gaps = [b.observed_at - a.observed_at for a, b in itertools.pairwise(got)]
    # the schedule is fixed: never two samples in one interval, and on average one per interval
    assert min(gaps) > 0.25 * 0.5, gaps
    assert 0.2 <= sum(gaps) / len(gaps) <= 0.4, gaps


async def test_a_prepared_claim_makes_its_gpu_busy_and_unprepare_idle_again(bus: Bus, tmp_path: Path) -> None:
    queue = await telemetry(bus, "n2")
    async with running_discovery(bus, "n2", "h100x2", tmp_path, telemetry_interval=0.2) as disc:
        idle = await until(queue, lambda d: len(d) == 2)
        for d in idle.devices:
            assert d.sm_percent is not None and d.sm_percent <= 2, d
            assert d.memory_used_bytes is not None and d.memory_used_bytes < (80 << 30) // 50, d
            assert d.power_mw is not None and d.power_mw < 100_000, d  # ~10% of 700 W
        gpu1 = disc.inventory.gpus[1]
        await claim_event(bus, "n2", "prepared", gpu1.uuid, "gpu-1")
        busy = await until(queue, lambda d: (d["gpu-1"].sm_percent or 0) >= 50)
        by_name = {d.device: d for d in busy.devices}
        hot, cold = by_name["gpu-1"], by_name["gpu-0"]
        assert hot.memory_used_bytes is not None and hot.memory_used_bytes > (80 << 30) // 2
        assert hot.power_mw is not None and cold.power_mw is not None and hot.power_mw > 3 * cold.power_mw
        assert hot.temperature_c is not None and cold.temperature_c is not None
        assert hot.temperature_c > cold.temperature_c + 20
        assert (cold.sm_percent or 0) <= 2, "a GPU no claim holds stays idle"
        await claim_event(bus, "n2", "unprepared", gpu1.uuid, "gpu-1")
        await until(queue, lambda d: (d["gpu-1"].sm_percent or 0) <= 2)


async def test_mig_devices_report_memory_and_a_mig_gpu_no_sm_percent(bus: Bus, tmp_path: Path) -> None:
    machine = tmp_path / "m.yaml"
    machine.write_text(
        "gpus:\n- profile: h100\n  mig_enabled: true\n  mig_devices:\n"
        "  - {profile: 3g.40gb, placement: 0}\n  - {profile: 3g.40gb, placement: 4}\n"
    )
    queue = await telemetry(bus, "n3")
    async with running_discovery(bus, "n3", machine=str(machine), root=tmp_path, telemetry_interval=0.2) as disc:
        gpu = disc.inventory.gpus[0]
        first = await until(queue, lambda d: len(d) == 3)
        by_name = {d.device: d for d in first.devices}
        assert by_name["gpu-0"].sm_percent is None, "NVML gives no SM % of a GPU in MIG mode"
        assert by_name["gpu-0"].power_mw is not None and by_name["gpu-0"].temperature_c is not None
        mig = gpu.mig_devices[0]
        assert 0 < (by_name[mig.name].memory_total_bytes or 0) < 80 << 30
        assert by_name[mig.name].sm_percent is None and by_name[mig.name].power_mw is None
        await claim_event(bus, "n3", "prepared", mig.uuid, mig.name)
        busy = await until(
            queue, lambda d: (d[mig.name].memory_used_bytes or 0) > (d[mig.name].memory_total_bytes or 0) // 2
        )
        assert (busy.devices[0].power_mw or 0) > (by_name["gpu-0"].power_mw or 0), "half the GPU busy draws more"


async def test_zero_turns_sampling_off_and_a_faster_rate_is_refused(bus: Bus, tmp_path: Path) -> None:
    async with running_discovery(bus, "n4", "h100x1", tmp_path, telemetry_interval=0) as disc:
        assert disc.service.sampler is None
    assert parse(["--simulate", "h100x1", "--telemetry-interval", "0"]).telemetry_interval == 0
    with pytest.raises(ConfigError, match=r"at least 0\.2"):
        parse(["--simulate", "h100x1", "--telemetry-interval", "0.05"])
