"""`gpu-dra demo`: the main job on embedded defaults.

Until the local cluster lands, the demo runs the event bus end to end: an embedded nats-server
with JetStream, a simulated node's inventory published as a traced event, a consumer in the
same trace, and the catalog's subjects; then it tears everything down and exits 0.
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry import trace

from shared.bus import Bus, MsgContext
from shared.events import catalog
from shared.events.inventory import Gpu, NodeInventory
from shared.logs import setup_logging
from shared.natsserver import EmbeddedNats
from shared.telemetry import memory_spans, setup_telemetry


def _simulated_inventory(node: str, count: int = 8) -> NodeInventory:
    gpus = [
        Gpu(name=f"gpu-{i}", index=i, minor=i, uuid=f"GPU-{node}-{i:04d}", product_name="NVIDIA H100 80GB HBM3",
            brand="Nvidia", architecture="Hopper", cuda_compute_capability="9.0.0", memory_bytes=80 << 30,
            pci_bus_id=f"0000:{0x18 + i * 0x10:02x}:00.0", mig_capable=True)
        for i in range(count)
    ]
    return NodeInventory(node=node, driver_version="550.163.1", cuda_driver_version="12.4.0", gpus=gpus,
                         simulated=True, observed_at=time.time())


async def _demo() -> None:
    tracer = trace.get_tracer("gpu-dra.demo")
    async with EmbeddedNats() as nats_srv:
        print(f"embedded nats-server with JetStream at {nats_srv.url}")
        producer = await Bus.connect(nats_srv.url, name="demo-discovery")
        consumer = await Bus.connect(nats_srv.url, name="demo-publisher")
        await producer.provision()
        received: asyncio.Queue[NodeInventory] = asyncio.Queue()

        async def on_inventory(msg: NodeInventory, ctx: MsgContext) -> None:
            await received.put(msg)

        await consumer.subscribe(catalog.INVENTORY, on_inventory)
        with tracer.start_as_current_span("discovery.scan"):
            await producer.publish(catalog.INVENTORY, _simulated_inventory("node-1"), node="node-1")
        inventory = await asyncio.wait_for(received.get(), timeout=10)
        print(f"\n{'NODE':<8} {'DEVICE':<7} {'UUID':<20} PRODUCT")
        for gpu in inventory.gpus:
            print(f"{inventory.node:<8} {gpu.name:<7} {gpu.uuid:<20} {gpu.product_name}")
        spans = sorted(memory_spans(), key=lambda s: s.start_time or 0)
        if spans:
            t0 = spans[0].start_time or 0
            print("\ntrace of one inventory change:")
            for span in spans:
                start_ms = ((span.start_time or 0) - t0) / 1e6
                dur_ms = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
                print(f"  {start_ms:8.2f} ms  {dur_ms:7.2f} ms  {span.name}")
        print("\nsubjects:")
        for entry in catalog.CATALOG:
            print(f"  {entry.subject:<44} {entry.message.__name__}")
        await producer.close()
        await consumer.close()
    print("\ndemo finished: all services stopped")


def main(argv: list[str]) -> int:
    setup_logging("demo", "warning")
    setup_telemetry("gpu-dra-demo", "memory")
    asyncio.run(_demo())
    return 0
