"""A consumer in its own process for the bus tests: prints each decoded inventory and the span ids."""

from __future__ import annotations

import asyncio
import sys

from opentelemetry import trace

from shared.bus import Bus, MsgContext
from shared.events import catalog
from shared.events.inventory import NodeInventory
from shared.telemetry import setup_telemetry


async def main(url: str, trace_file: str) -> None:
    setup_telemetry("test-consumer", f"file:{trace_file}")
    bus = await Bus.connect(url, name="test-consumer")
    done = asyncio.Event()

    async def on_inventory(msg: NodeInventory, ctx: MsgContext) -> None:
        span = trace.get_current_span().get_span_context()
        print(f"GOT node={msg.node} gpus={len(msg.gpus)} trace={span.trace_id:032x}", flush=True)
        if msg.node == "last":
            done.set()

    await bus.subscribe(catalog.INVENTORY, on_inventory, durable="test-consumer")
    print("READY", flush=True)
    await done.wait()
    await bus.close()
    trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
