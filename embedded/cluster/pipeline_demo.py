"""`gpu-dra pipeline-demo`: the inventory half of the driver, in one process, in seconds.

Runs the inventory pipeline for real on one machine: an embedded nats-server with JetStream, the
embedded API server, discovery on a simulated node (8x H100 plus a MIG-partitioned A100), and the
publisher; shows the ResourceSlices that come out (devices, UUIDs, capacities), then injects an
XID and shows the device taint appear and clear, and prints the trace of the inventory change as
a waterfall across the services. Tears everything down and exits 0.

The full workload demo (`gpu-dra demo`, what `make run` runs) is `embedded/cluster/demo.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from embedded.apiserver.testing import running_apiserver
from embedded.cluster.waterfall import render, traces_with
from embedded.harness.discovery import running_discovery
from embedded.harness.publisher import ensure_node, node_slices, running_publisher, until
from shared.bus import Bus
from shared.events import catalog
from shared.events.devices import InjectXidRequest
from shared.logs import setup_logging
from shared.natsserver import EmbeddedNats
from shared.telemetry import memory_spans, setup_telemetry
from shared.tracing_sdk import span_to_dict

NODE = "gpu-node-0"
MACHINE = """\
gpus:
- profile: h100
  count: 8
- profile: a100-40gb
  mig_enabled: true
  mig_devices:
  - {profile: 3g.20gb, placement: 0}
  - {profile: 1g.5gb, placement: 4}
"""


def _devices(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for s in slices for d in s["spec"].get("devices") or []]


def _print_devices(slices: list[dict[str, Any]]) -> None:
    print(f"  {'DEVICE':<24} {'TYPE':<5} {'PRODUCT':<24} {'MEMORY':<8} {'NUMA':<5} UUID")
    for d in _devices(slices):
        a = d.get("attributes") or {}
        mem = ((d.get("capacity") or {}).get("memory") or {}).get("value", "")
        print(
            f"  {d['name']:<24} {a['type']['string']:<5} {a['productName']['string'][:24]:<24} {mem:<8} "
            f"{a.get('numaNode', {}).get('int', ''):<5} {a.get('uuid', {}).get('string', '')}"
        )


async def _demo(work: Path) -> int:
    machine = work / "machine.yaml"
    machine.write_text(MACHINE)
    async with EmbeddedNats(store_dir=work / "nats") as nats_srv, running_apiserver(work) as api:
        print(f"embedded nats-server (JetStream)  {nats_srv.url}")
        print(f"embedded API server               {api.url}  (kubeconfig {api.kubeconfig_path})")
        bus = await Bus.connect(nats_srv.url, name="demo")
        await bus.provision()
        try:
            async with api.client() as client_:
                await ensure_node(client_, NODE)
            async with (
                running_publisher(nats_srv.url, str(api.kubeconfig_path)) as publisher,
                running_discovery(bus, NODE, machine=str(machine), root=work / "nodes") as disc,
            ):
                print(f"discovery on {NODE}: {len(disc.inventory.gpus)} simulated GPUs; publisher running\n")
                async with api.client() as client_:

                    async def published() -> bool:
                        return len(_devices(await node_slices(client_, NODE))) >= 10

                    await until(publisher, published, timeout=30)
                    slices = await node_slices(client_, NODE)
                    print(f"ResourceSlices for {NODE} ({len(slices)} slice(s), driver gpu.nvidia.com):")
                    _print_devices(slices)

                    gpu = disc.inventory.gpus[3]
                    reply = await bus.request(
                        catalog.DEVICE_INJECT_XID, InjectXidRequest(gpu_uuid=gpu.uuid, xid=79), timeout=10, node=NODE
                    )
                    assert reply.ok, reply.error

                    async def tainted(want: bool) -> bool:
                        dev = next(d for d in _devices(await node_slices(client_, NODE)) if d["name"] == gpu.name)
                        return bool(dev.get("taints")) == want

                    await until(publisher, lambda: tainted(True), timeout=30)
                    dev = next(d for d in _devices(await node_slices(client_, NODE)) if d["name"] == gpu.name)
                    print(f"\ninjected XID 79 on {gpu.name}: taints {dev['taints']}")
                    await bus.request(
                        catalog.DEVICE_INJECT_XID,
                        InjectXidRequest(gpu_uuid=gpu.uuid, recover=True),
                        timeout=10,
                        node=NODE,
                    )
                    await until(publisher, lambda: tainted(False), timeout=30)
                    print(f"recovered {gpu.name}: taint removed")
        finally:
            await bus.close()
    spans = [span_to_dict(s) for s in memory_spans()]
    traces = traces_with(spans, "discovery.publish-inventory")
    if traces:
        print("\nthe first inventory change, traced from discovery through NATS to the API write:\n")
        print(render(traces[-1]))
    print("\ndemo finished: all services stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    # --help (no options): the module doc's first line, which stays whatever its later paragraphs become
    argparse.ArgumentParser(prog="gpu-dra pipeline-demo", description=(__doc__ or "").split("\n")[0]).parse_args(argv)
    setup_logging("gpu-dra-demo", "warning")
    setup_telemetry("gpu-dra-demo", "memory")
    with tempfile.TemporaryDirectory(prefix="gpu-dra-demo-") as work:
        return asyncio.run(_demo(Path(work)))
