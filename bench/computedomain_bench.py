"""ComputeDomain readiness: last IMEX daemon Ready -> domain Ready, and bring-up, for 1..N domains at once.

Runs a real nats-server, the embedded API server, the controller, and `--domains` x `--nodes` simulated
GB200 nodes (discovery + agent each, each agent supervising a simulated IMEX daemon on its own loopback
address; two cliques per domain), in this process or in `--node-processes` processes of their own
(bench/computedomain_nodes.py). Each round creates the domains, waits for the controller to announce
them (what lets the scheduler allocate their channel claims), prepares one channel claim per node, all
at once, through the channel preparer core, and records on one clock in this process:
  last_ready -> status   the domain's last member Ready (KV watch) to the CR watch showing `status: Ready`
  last_ready -> event    the same, to the `dra.v1.cd.<uid>.status` Ready event
  bring-up               the domain's first prepare to its status Ready (daemons start and connect to peers)
  all domains            the last daemon Ready of all domains -> every domain Ready (--domains > 1)
and a timeline per node (prepare called, membership joined, daemon process spawned, daemon Ready, member
Ready seen in KV, prepare returned; controller: status written, status seen), from the components' own log
lines and KV entries. Then deletes the domains and checks that nothing is left. Upstream polls every 2 s;
the goal is 1 s.

`--daemon subprocess` (default) runs `python -m services.computedomain.imexd` per node, the agent's own
simulated daemon. `--daemon in-process` (bench only) runs a socket-less stand-in (bench/computedomain_sim.py: the
simulator's own config parsers, Ready once every peer it resolves runs) in the nodes' process, for domain counts
whose daemon processes this machine cannot hold: its
figure is the control plane's (last daemon Ready -> all domains Ready), which does not depend on how a
daemon is started; its bring-up is not a daemon's.

    .venv/bin/python bench/computedomain_bench.py [--nodes 18] [--rounds 5] [--domains 1] [--daemon subprocess]
        [--hold-last] [--node-processes 0]
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kubernetes_asyncio import client, watch  # noqa: E402

from bench.computedomain_nodes import (  # noqa: E402
    NS,
    LocalNodes,
    NodeProcess,
    NodesSpec,
    Timeline,
    settle,
)
from bench.computedomain_sim import daemon_startup_ms  # noqa: E402
from bench.procstats import memory_mib  # noqa: E402
from embedded.apiserver.testing import running_apiserver  # noqa: E402
from services.computedomain import crd  # noqa: E402
from services.computedomain.controller import Controller  # noqa: E402
from services.computedomain.membership import Membership  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.events.catalog import BUCKETS, CD_STATUS, STREAMS  # noqa: E402
from shared.logs import setup_logging  # noqa: E402
from shared.natsserver import EmbeddedNats  # noqa: E402
from shared.ports import free_port  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "computedomain.json"
PHASES = ["prepare_called", "joined", "spawned", "daemon_ready", "member_ready_seen", "prepared"]
Nodes = LocalNodes | NodeProcess


async def one_round(
    custom: Any,
    bus: Bus,
    controller: Controller,
    groups: list[Nodes],
    per: int,
    tag: str,
    tl: Timeline,
    hold_last: bool = False,
) -> dict[str, Any]:
    nodes = [node for g in groups for node in g.nodes]
    names = [f"cd-{tag}-{d}" for d in range(len(nodes) // per)]
    held = {nodes[(d + 1) * per - 1] for d in range(len(names))} if hold_last else set()
    others_ready = asyncio.Event()  # every member Ready in KV but the held ones
    announced: dict[str, asyncio.Event] = {}
    ready_event: dict[str, float] = {}
    status_seen: dict[str, float] = {}
    all_ready = asyncio.Event()

    async def on_status(msg: Any, _ctx: Any) -> None:
        if msg.domain_name not in names:
            return
        announced.setdefault(msg.domain_name, asyncio.Event()).set()
        if msg.status == "Ready" and msg.nodes == per:
            ready_event.setdefault(msg.domain_name, time.time())

    async def follow_crs() -> None:
        async with watch.Watch() as stream:
            async for event in stream.stream(
                custom.list_namespaced_custom_object, crd.GROUP, crd.VERSION, NS, crd.PLURAL
            ):
                obj = event["object"]
                status = obj.get("status") or {}
                name = obj["metadata"]["name"]
                if name in names and status.get("status") == "Ready" and len(status.get("nodes") or []) == per:
                    status_seen.setdefault(name, time.time())
                    if len(status_seen) == len(names):
                        all_ready.set()

    member_ready: dict[str, float] = {}  # "<uid>/<node>" -> seen
    replayed = asyncio.Event()

    async def follow_members() -> None:
        async for _d, node, m in Membership(bus).watch():
            if node == "":
                replayed.set()
            elif m is not None and m.status == "Ready":
                tl.mark(m.domain_uid, m.node, "daemon_ready", m.observed_at)
                tl.mark(m.domain_uid, m.node, "member_ready_seen")
                member_ready.setdefault(f"{m.domain_uid}/{m.node}", time.time())
                if len(member_ready) >= len(nodes) - len(held):
                    others_ready.set()

    sub = await bus.subscribe(CD_STATUS, on_status)
    tasks = [asyncio.create_task(follow_crs()), asyncio.create_task(follow_members())]
    await replayed.wait()
    uids: dict[str, str] = {}
    for name in names:
        announced.setdefault(name, asyncio.Event())
        created = await custom.create_namespaced_custom_object(
            crd.GROUP,
            crd.VERSION,
            NS,
            crd.PLURAL,
            {
                "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
                "kind": crd.KIND,
                "metadata": {"name": name},
                "spec": {"channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}},
            },
        )
        uids[name] = created["metadata"]["uid"]
    # the controller's first announcement: until then an agent cannot look the domain up (kubelet would retry)
    await asyncio.wait_for(asyncio.gather(*(announced[n].wait() for n in names)), 60)

    for g in groups:
        g.hold(held)
    start = time.time()
    prepared = asyncio.gather(*(g.prepare(uids) for g in groups))
    held_figures: dict[str, Any] = {}
    if held:
        # every domain up but its last daemon, whose Ready waits at the gate; then quiet loops, then all at once
        await asyncio.wait_for(others_ready.wait(), 600)
        lags = await asyncio.gather(*(g.gate_full() for g in groups))
        held_figures["held_s"] = round(time.time() - start, 1)
        held_figures["loop_lag_at_open_ms"] = await settle()
        held_figures["node_loops_lag_at_open_ms"] = max(lags)
        opened = time.time()
        for g in groups:
            g.open()
        await asyncio.wait_for(all_ready.wait(), 120)
        held_figures["opened_to_all_ready_ms"] = round((max(status_seen.values()) - opened) * 1000, 2)
        held_marks = [m for (u, n), m in tl.marks.items() if n in held and u in uids.values()]
        for phase in ("daemon_ready", "member_ready_seen"):  # the agents' Ready writes, and the bench seeing them
            at = [m[phase] for m in held_marks if phase in m]
            held_figures[f"opened_to_held_{phase}_ms"] = [
                round((min(at) - opened) * 1000, 1),
                round((max(at) - opened) * 1000, 1),
            ]
        print(f"round {tag}: {json.dumps(held_figures)}", flush=True)  # kept if the round fails after
    retried: list[str] = []
    for reported in await prepared:
        retried += reported.retried
        for uid, node, marks in reported.marks:
            for what, when in marks.items():
                tl.mark(uid, node, what, when)
    await asyncio.wait_for(all_ready.wait(), 120)
    consumers_at_ready = await consumers_per_stream(bus)
    while len(ready_event) < len(names):
        await asyncio.sleep(0.01)  # the event and the CR watch race; the event is at most a few ms behind
    await sub.unsubscribe()
    for task in tasks:
        task.cancel()

    per_domain = []
    for name in names:
        uid = uids[name]
        last = max(v for k, v in member_ready.items() if k.startswith(uid + "/"))
        first = min(tl.marks[(uid, node)]["prepare_called"] for node in nodes if (uid, node) in tl.marks)
        per_domain.append(
            {
                "last_ready_to_status_ms": (status_seen[name] - last) * 1000,
                "last_ready_to_event_ms": (ready_event[name] - last) * 1000,
                "bring_up_ms": (status_seen[name] - first) * 1000,
                "status_written_ms": (controller.domains[uid].ready_written_at - first) * 1000,
            }
        )
    last_all = max(member_ready.values())
    timeline: dict[str, dict[str, float]] = {}
    for phase in PHASES:
        offsets = [(m[phase] - start) * 1000 for (u, _n), m in tl.marks.items() if u in uids.values() and phase in m]
        if not offsets:
            continue  # no daemon process spawned (--daemon in-process)
        timeline[phase] = {"median_ms": round(statistics.median(offsets), 1), "last_ms": round(max(offsets), 1)}
    timeline["status_written"] = {"last_ms": round(max(d["status_written_ms"] for d in per_domain), 1)}
    timeline["status_seen"] = {"last_ms": round((max(status_seen.values()) - start) * 1000, 1)}
    result = {
        "last_ready_to_status_ms": statistics.median(d["last_ready_to_status_ms"] for d in per_domain),
        "last_ready_to_event_ms": statistics.median(d["last_ready_to_event_ms"] for d in per_domain),
        "bring_up_ms": statistics.median(d["bring_up_ms"] for d in per_domain),
        "max_bring_up_ms": max(d["bring_up_ms"] for d in per_domain),
        "last_ready_to_all_ready_ms": (max(status_seen.values()) - last_all) * 1000,
        "consumers_at_all_ready": consumers_at_ready,
        "prepares_retried": len(retried),
        "timeline": timeline,
        **held_figures,
    }
    # tear down and check that nothing is left
    for name in names:
        await custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, NS, crd.PLURAL, name)
    limit_s = max(60.0, 0.2 * len(nodes))  # 1,152 members leave in one process in about a minute
    deadline = time.monotonic() + limit_s
    left = set(uids.values())  # domains whose members are still listed (each listing is a consumer: asked once)
    while time.monotonic() < deadline:
        listed = await custom.list_namespaced_custom_object(crd.GROUP, crd.VERSION, NS, crd.PLURAL)
        if not listed["items"]:
            left = {u for u in left if await Membership(bus).members(u)}
            if not left:
                break
        await asyncio.sleep(0.1)
    else:
        raise RuntimeError(f"round {tag}: domains not cleaned up within {limit_s:.0f} s")
    return result


async def consumers_per_stream(bus: Bus) -> dict[str, int]:
    """How many consumers each stream and KV bucket has now (the stream's state, as the server counts them
    against its limit; ended ones are gone, stopped ones whose inactive threshold has not passed are not)."""
    names = [s.name for s in STREAMS] + [f"KV_{b.name}" for b in BUCKETS]
    return {name: int((await bus.js.stream_info(name)).state.consumer_count or 0) for name in names}


def resources(nats: EmbeddedNats) -> dict[str, Any]:
    """This process's and nats-server's resident memory (MiB) and open file descriptors."""
    server = nats.proc.pid if nats.proc is not None else 0
    return {
        "bench_rss_mib": memory_mib("self")[0],
        "bench_fds": len(list(Path("/proc/self/fd").iterdir())),
        "nats_server_rss_mib": memory_mib(server)[0] if server else 0.0,
        "nats_server_fds": len(list(Path(f"/proc/{server}/fd").iterdir())) if server else 0,
    }


async def main_async(
    nodes: int, rounds: int, domains: int, daemon: str, hold_last: bool = False, node_processes: int = 0
) -> dict[str, Any]:
    tl = Timeline()
    tl.install()
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
                await client.CoreV1Api(kube).create_namespace({"metadata": {"name": NS}})
                controller = Controller(kube, bus)
                tasks = [asyncio.create_task(controller.run(stopping))]
                set_up_from = time.monotonic()
                # the domains split as evenly as they go among the node processes (none: all in this one)
                shares = [
                    domains // max(1, node_processes) + (k < domains % node_processes) for k in range(node_processes)
                ]
                specs, first = [], 0
                for count in [c for c in shares if c] or [domains]:
                    specs.append(NodesSpec(nats.url, str(root), first, count, nodes, daemon, domains > 1, free_port()))
                    first += count
                groups: list[Nodes] = (
                    [NodeProcess(spec) for spec in specs] if node_processes else [LocalNodes(specs[0], bus, tl)]
                )
                for g in groups:
                    stack.push_async_callback(g.stop)
                await asyncio.gather(*(g.start() for g in groups))
                set_up_s = round(time.monotonic() - set_up_from, 1)
                consumers_idle = await consumers_per_stream(bus)
                custom = client.CustomObjectsApi(kube)
                results = [
                    await one_round(custom, bus, controller, groups, nodes, str(r), tl, hold_last)
                    for r in range(rounds)
                ]
                used = resources(nats)
                used["node_processes_rss_mib"] = [g.rss_mib() for g in groups if isinstance(g, NodeProcess)]
                stopping.set()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await bus.close()
            await nats.close()
    startup = await daemon_startup_ms(nodes) if daemon == "subprocess" else None

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in results), 2)

    figures: dict[str, Any] = {
        "benchmark": "computedomain",
        "nodes": nodes,
        "cliques": 2,
        "rounds": rounds,
        "domains": domains,
        "daemon": daemon,
        "hold_last": hold_last,
        "node_processes": node_processes,
        "median_last_daemon_ready_to_domain_ready_status_ms": med("last_ready_to_status_ms"),
        "median_last_daemon_ready_to_status_event_ms": med("last_ready_to_event_ms"),
        "max_last_daemon_ready_to_domain_ready_status_ms": round(max(r["last_ready_to_status_ms"] for r in results), 2),
        "median_bring_up_ms": med("bring_up_ms"),
        "median_max_bring_up_ms": med("max_bring_up_ms"),
        "median_last_daemon_ready_to_all_domains_ready_ms": med("last_ready_to_all_ready_ms"),
        "median_timeline_ms": {
            phase: {k: round(statistics.median(r["timeline"][phase][k] for r in results), 1) for k in marks}
            for phase, marks in results[0]["timeline"].items()
        },
        **(
            {
                "median_opened_to_all_ready_ms": med("opened_to_all_ready_ms"),
                "max_opened_to_all_ready_ms": max(r["opened_to_all_ready_ms"] for r in results),
                "median_loop_lag_at_open_ms": med("loop_lag_at_open_ms"),
            }
            if hold_last
            else {}
        ),
        "simulated_daemon_startup_ms": startup,
        # per stream: after set-up (every node's discovery and agent running, no domain), and when all domains
        # turned Ready (the last round); per node: their sum over the streams, divided by the node count
        "consumers_idle": consumers_idle,
        "consumers_at_all_ready": results[-1]["consumers_at_all_ready"],
        "consumers_per_node_idle": round(sum(consumers_idle.values()) / (nodes * domains), 2),
        "consumers_per_node_at_all_ready": round(
            sum(results[-1]["consumers_at_all_ready"].values()) / (nodes * domains), 2
        ),
        "resources_at_end": used,
        "set_up_s": set_up_s,
        "goal_ms": 1000,
        "upstream_status_poll_ms": 2000,
        "load_average": [round(x, 2) for x in __import__("os").getloadavg()],
        "rounds_detail": [
            {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if k != "timeline"} for r in results
        ],
    }
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=18)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--domains", type=int, default=1)
    parser.add_argument("--daemon", choices=["subprocess", "in-process"], default="subprocess")
    parser.add_argument(
        "--hold-last",
        action="store_true",
        help="in-process daemons: hold each domain's last daemon at its Ready until the rest are up and the "
        "process is quiet, then let them all turn Ready at once (bench/computedomain_sim.py, ReadyGate)",
    )
    parser.add_argument(
        "--node-processes",
        type=int,
        default=0,
        help="run the nodes in this many processes of their own, each with its own NATS connection, the domains "
        "split among them (0: in the bench process, with the controller)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file (merged: other runs' keys stay)")
    parser.add_argument("--key", default="", help="store the figures under this key of the results file")
    args = parser.parse_args()
    setup_logging("bench", "warning")
    if args.hold_last and args.daemon != "in-process":
        parser.error("--hold-last holds in-process daemons only (--daemon in-process)")
    figures = asyncio.run(
        main_async(args.nodes, args.rounds, args.domains, args.daemon, args.hold_last, args.node_processes)
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(args.out.read_text()) if args.out.exists() else {}
    existing.update({args.key: figures} if args.key else figures)
    args.out.write_text(json.dumps(existing, indent=2) + "\n")
    print(json.dumps({k: v for k, v in figures.items() if k != "rounds_detail"}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
