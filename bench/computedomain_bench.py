"""ComputeDomain readiness latency: time from the last IMEX daemon Ready to the domain Ready, 18 nodes.

Runs a real nats-server, the embedded API server, the controller, and 18 simulated GB200 nodes
(discovery + agent, each agent supervising a simulated IMEX daemon process on its own loopback
address). Each round creates a ComputeDomain, prepares one channel claim per node through the
channel preparer core, and records, on one clock in this process:
  last_ready -> status   the last member's Ready (KV watch) to the CR watch showing `status: Ready`
  last_ready -> event    the same, to the `dra.v1.cd.<uid>.status` Ready event
  bring-up               first prepare to domain Ready (18 daemons start and connect to 17 peers)
then deletes the domain and checks that nothing is left. Upstream polls every 2 s; the goal is 1 s.

    .venv/bin/python bench/computedomain_bench.py [--nodes 18] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kubernetes_asyncio import client, watch  # noqa: E402

from embedded.apiserver.testing import running_apiserver  # noqa: E402
from embedded.harness.discovery import running_discovery  # noqa: E402
from services.computedomain import crd  # noqa: E402
from services.computedomain.agent import Agent  # noqa: E402
from services.computedomain.channelcore import (  # noqa: E402
    ChannelClaim,
    ChannelPreparer,
    channel_config,
    parse_channel_config,
)
from services.computedomain.config import AgentConfig  # noqa: E402
from services.computedomain.controller import Controller  # noqa: E402
from services.computedomain.membership import Membership  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.events.catalog import CD_STATUS  # noqa: E402
from shared.logs import setup_logging  # noqa: E402
from shared.natsserver import EmbeddedNats  # noqa: E402
from shared.ports import free_port  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "computedomain.json"


async def one_round(custom, bus: Bus, preparers: list[ChannelPreparer], n: int, name: str) -> dict[str, float]:
    created = await custom.create_namespaced_custom_object(
        crd.GROUP,
        crd.VERSION,
        "bench",
        crd.PLURAL,
        {
            "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
            "kind": crd.KIND,
            "metadata": {"name": name},
            "spec": {"channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}},
        },
    )
    uid = created["metadata"]["uid"]
    member_ready: dict[str, float] = {}
    marks: dict[str, float] = {}
    done_status, done_event = asyncio.Event(), asyncio.Event()

    async def follow_members() -> None:
        async for _d, node, m in Membership(bus).watch(uid):
            if m is not None and m.status == "Ready" and node not in member_ready:
                member_ready[node] = time.perf_counter()

    async def follow_cr() -> None:
        async with watch.Watch() as stream:
            async for event in stream.stream(
                custom.list_namespaced_custom_object,
                crd.GROUP,
                crd.VERSION,
                "bench",
                crd.PLURAL,
                field_selector=f"metadata.name={name}",
            ):
                status = event["object"].get("status") or {}
                if status.get("status") == "Ready" and len(status.get("nodes") or []) == n:
                    marks["status"] = time.perf_counter()
                    done_status.set()
                    return

    async def on_status(msg, _ctx) -> None:
        if msg.domain_uid == uid and msg.status == "Ready" and msg.nodes == n and "event" not in marks:
            marks["event"] = time.perf_counter()
            done_event.set()

    sub = await bus.subscribe(CD_STATUS, on_status)
    tasks = [asyncio.create_task(follow_members()), asyncio.create_task(follow_cr())]
    await asyncio.sleep(0.2)  # the CR watch and the KV watch are established
    cfg = parse_channel_config(channel_config(uid))
    start = time.perf_counter()
    await asyncio.gather(
        *(p.prepare(ChannelClaim(f"{name}-{i}", "bench", f"{name}-{i}", cfg)) for i, p in enumerate(preparers))
    )
    await asyncio.wait_for(asyncio.gather(done_status.wait(), done_event.wait()), 30)
    await sub.unsubscribe()
    last_ready = max(member_ready.values())
    result = {
        "last_ready_to_status_ms": (marks["status"] - last_ready) * 1000,
        "last_ready_to_event_ms": (marks["event"] - last_ready) * 1000,
        "bring_up_ms": (marks["status"] - start) * 1000,
    }
    for task in tasks:
        task.cancel()
    # tear down and check that nothing is left
    await custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, "bench", crd.PLURAL, name)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        listed = await custom.list_namespaced_custom_object(crd.GROUP, crd.VERSION, "bench", crd.PLURAL)
        if not listed["items"] and not await Membership(bus).members(uid):
            break
        await asyncio.sleep(0.1)
    else:
        raise RuntimeError(f"domain {name} was not cleaned up within 20 s")
    return result


async def main_async(nodes: int, rounds: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="cd-bench-") as tmp:
        root = Path(tmp)
        nats = EmbeddedNats(store_dir=root / "nats")
        await nats.start()
        bus = await Bus.connect(nats.url, name="bench")
        await bus.provision()
        stopping = asyncio.Event()
        try:
            async with running_apiserver(root) as api, api.client() as kube, contextlib.AsyncExitStack() as stack:
                ext = client.ApiextensionsV1Api(kube)
                for body in crd.crds():
                    await ext.create_custom_resource_definition(body)
                await client.CoreV1Api(kube).create_namespace({"metadata": {"name": "bench"}})
                controller = Controller(kube, bus)
                tasks = [asyncio.create_task(controller.run(stopping))]
                port = free_port()
                preparers = []
                for i in range(nodes):
                    node = f"gb200-{i:02d}"
                    clique = 1 + i // 9  # two cliques of nine
                    await stack.enter_async_context(
                        running_discovery(bus, node, simulate=f"gb200x4:clique={clique}", root=root / "sim")
                    )
                    cfg = AgentConfig(
                        node=node,
                        ip_address=f"127.0.99.{i + 1}",
                        state_dir=str(root / "agents" / node),
                        imex_server_port=port,
                        imex_cmd_port=port + 1,
                        imex_daemon="simulated",
                    ).resolved()
                    agent = Agent(cfg, bus)
                    tasks.append(asyncio.create_task(agent.run(stopping)))
                    await agent.ready.wait()
                    preparers.append(
                        ChannelPreparer(
                            bus, node=node, dev_root=str(root / "sim" / node), ready_timeout=30, simulated=True
                        )
                    )
                results = [
                    await one_round(client.CustomObjectsApi(kube), bus, preparers, nodes, f"cd-{r}")
                    for r in range(rounds)
                ]
                stopping.set()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await bus.close()
            await nats.close()

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in results), 2)

    return {
        "benchmark": "computedomain",
        "nodes": nodes,
        "cliques": 2,
        "rounds": rounds,
        "median_last_daemon_ready_to_domain_ready_status_ms": med("last_ready_to_status_ms"),
        "median_last_daemon_ready_to_status_event_ms": med("last_ready_to_event_ms"),
        "max_last_daemon_ready_to_domain_ready_status_ms": round(max(r["last_ready_to_status_ms"] for r in results), 2),
        "median_bring_up_ms": med("bring_up_ms"),
        "goal_ms": 1000,
        "upstream_status_poll_ms": 2000,
        "rounds_detail": [{k: round(v, 2) for k, v in r.items()} for r in results],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=18)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    setup_logging("bench", "warning")
    figures = asyncio.run(main_async(args.nodes, args.rounds))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n")
    for key, value in figures.items():
        if key != "rounds_detail":
            print(f"{key:<56} {value}")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
