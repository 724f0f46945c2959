"""Chaos run: a churn of pods on `gpu-dra up` while every service is killed with SIGKILL, then the invariants.

Everything is real: `gpu-dra up` (its processes, supervised: a killed one is restarted with backoff),
pods with ResourceClaimTemplates (one GPU, or one time-sliced GPU) created and deleted through the
API server, the example ledger (`python -m examples.ledger`) consuming DRA_EVENTS as a process of its
own. A seeded schedule kills each service (per node: preparer, discovery, kubelet emulator; and the
publisher, scheduler, API server, nats-server) `--kills` times at random points of the churn.

Then, with the kills over and every pod gone, it checks (issue 16, item 7):
- pods: created, succeeded (Running), stuck (never Running, or never gone once deleted);
- leaks per node: checkpoint entries vs CDI claim spec files vs claims allocated there with pods
  (checked with a last set of pods running, then with none), and a sharing policy (time-slice, compute
  mode, MPS daemon) left on a GPU no claim holds, read from the simulated NVML state;
- doubles: a device held by two claims (checkpoints and allocations, sampled throughout);
- events: every event id exactly once in DRA_EVENTS, every preparation complete (started -> prepared ->
  unprepared, or rolled back), every pod that ran has its `prepared`; and the ledger holds every
  prepared/unprepared/rolled-back id once, with no use left open;
- recovery: from each preparer kill to the next `prepared` event of that node (median, max).

    .venv/bin/python bench/chaos.py [--pods 1000] [--seed 1] [--nodes 2] [--gpus h100x4] [--kills 2]

Prints the figures and writes them to bench/results/chaos.json. tests/chaos/ runs a short variant.

Its parts: bench/chaos_cluster.py (`gpu-dra up` and the API client), bench/chaos_churn.py (the pods and
the kill schedule), bench/chaos_checks.py (the invariants).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.chaos_checks import (  # noqa: E402
    STATE_CHANGING,
    check_events,
    checkpoint,
    figures,
    node_state,
    read_json,
    recovery,
    sample_doubles,
)
from bench.chaos_churn import (  # noqa: E402
    SHARED_CLAIM,
    TEMPLATES,
    Run,
    churn,
    is_running,
    kill_schedule,
    killer,
    pod_body,
    poll_pods,
    until,
)
from bench.chaos_cluster import (  # noqa: E402
    CLUSTER_TARGETS,
    NODE_TARGETS,
    NS,
    Api,
    UpProcess,
    admin_creds,
    admin_login,
    log,
    stream_events,
)
from shared.kube.resources import PODS, RESOURCECLAIMS, RESOURCECLAIMTEMPLATES, Kube  # noqa: E402
from shared.kube.rest import ApiError  # noqa: E402


async def settle(check: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout:.0f}s")
        await asyncio.sleep(0.5)


async def chaos(
    pods: int,
    seed: int,
    nodes: int = 2,
    gpus: str = "h100x4",
    kills_each: int = 2,
    concurrency: int = 0,
    pod_timeout: float = 120.0,
    keep: int = 0,
    data_dir: Path | None = None,
) -> dict[str, Any]:
    from shared.ports import free_port

    own = data_dir is None
    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="gpu-dra-chaos-"))
    up = UpProcess(data_dir, nodes, gpus, free_port())
    names = [f"gpu-node-{i}" for i in range(nodes)]
    run = Run(pods, seed, names)
    per_node = int(gpus.split("x")[-1]) if "x" in gpus else 1
    concurrency = concurrency or nodes * per_node
    keep = keep or nodes
    api = Api(up.kubeconfig)
    ledger: asyncio.subprocess.Process | None = None
    tasks: list[asyncio.Task[Any]] = []
    started = time.monotonic()
    try:
        await up.start(timeout=240)
        url = await up.nats_url()
        log(f"cluster up in {time.monotonic() - started:.1f}s ({nodes} nodes x {gpus}); nats {url}")
        schemas = data_dir / "schemas"
        done = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "shared.cli",
            "events",
            "schema",
            "--out",
            str(schemas),
            cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL,
        )
        assert await done.wait() == 0, "gpu-dra events schema failed"
        ledger_state = data_dir / "ledger.json"
        ledger = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "examples.ledger",
            "--schemas",
            str(schemas),
            "--nats",
            url,
            "--creds",
            str(admin_creds(data_dir)),
            "--inbox-prefix",
            "_INBOX_admin",
            "--state",
            str(ledger_state),
            cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=open(data_dir / "ledger.log", "wb"),  # noqa: ASYNC230, SIM115
            start_new_session=True,
        )
        for name, spec in TEMPLATES.items():

            async def create(k: Kube, name: str = name, spec: dict[str, Any] = spec) -> None:
                with contextlib.suppress(ApiError):
                    await k.create(
                        RESOURCECLAIMTEMPLATES,
                        NS,
                        {
                            "apiVersion": "resource.k8s.io/v1",
                            "kind": "ResourceClaimTemplate",
                            "metadata": {"name": name, "namespace": NS},
                            "spec": {"spec": {"devices": spec}},
                        },
                    )

            await api.call(create)

        async def create_shared(k: Kube) -> None:
            with contextlib.suppress(ApiError):
                await k.create(
                    RESOURCECLAIMS,
                    NS,
                    {
                        "apiVersion": "resource.k8s.io/v1",
                        "kind": "ResourceClaim",
                        "metadata": {"name": SHARED_CLAIM, "namespace": NS},
                        "spec": {"devices": TEMPLATES["chaos-gpu"]},
                    },
                )

        await api.call(create_shared)

        progress = asyncio.Condition()
        tasks = [asyncio.create_task(poll_pods(api, run)), asyncio.create_task(sample_doubles(up, api, run))]
        kill_task = asyncio.create_task(killer(up, run, kill_schedule(run, kills_each), progress))
        churn_started = time.monotonic()
        await churn(api, run, concurrency, pod_timeout, progress)
        churn_s = time.monotonic() - churn_started
        # Every kill's point in the churn has passed; one may still wait for its target to come back from the
        # kill before it (up to 60 s): it is carried out, not dropped, so each service is killed as scheduled.
        await kill_task
        log(f"churn done in {churn_s:.1f}s; waiting for every process to run again")

        async def all_running() -> bool:
            return all(up.pids(t) for t in CLUSTER_TARGETS) and all(up.pids(t, n) for n in names for t in NODE_TARGETS)

        await settle(all_running, 120, "every service running again")

        # A last set of pods runs: checkpoint = CDI specs = claims prepared there, per node.
        final = [f"chaos-final-{i}" for i in range(keep)]
        for name in final:
            await api.call(lambda k: k.create(PODS, NS, pod_body(name, "chaos-ts-gpu")))  # noqa: B023 - awaited here
        final_ok = await until(run, lambda: all(n in run.seen and is_running(run.seen[n]) for n in final), pod_timeout)
        claims, _ = await api.call(lambda k: k.list(RESOURCECLAIMS, NS))
        pods_now, _ = await api.call(lambda k: k.list(PODS, NS))
        with_pods = {n: node_state(up, n, claims, pods_now) for n in names}
        for name in final:
            await api.call(lambda k: k.delete(PODS, NS, name))  # noqa: B023 - awaited here
        await api.call(lambda k: k.delete(RESOURCECLAIMS, NS, SHARED_CLAIM))

        async def all_gone() -> bool:
            claims, _ = await api.call(lambda k: k.list(RESOURCECLAIMS, NS))
            return not any(n in run.seen for n in final) and not claims and not any(checkpoint(up, n) for n in names)

        with contextlib.suppress(RuntimeError):
            await settle(all_gone, pod_timeout, "every pod, claim and checkpoint entry gone")
        claims, _ = await api.call(lambda k: k.list(RESOURCECLAIMS, NS))
        empty = {n: node_state(up, n, claims, []) for n in names}

        async def stream_settled(last: list[int] = [-1]) -> bool:  # noqa: B006 - the last count seen
            count = len(await stream_events(url, admin_login(data_dir)))
            same, last[0] = count == last[0], count
            return same

        await settle(stream_settled, 60, "DRA_EVENTS settled")
        events = await stream_events(url, admin_login(data_dir))
        wanted = {f"id:{e['event_id']}" for e in events if e.get("event") in STATE_CHANGING}

        async def ledger_caught_up() -> bool:
            return wanted <= set(read_json(ledger_state).get("applied") or {})

        with contextlib.suppress(RuntimeError):
            await settle(ledger_caught_up, 60, "the ledger caught up")
        ledger.send_signal(signal.SIGTERM)
        await asyncio.wait_for(ledger.wait(), 30)
        book = read_json(ledger_state)
        applied = set(book.get("applied") or {})
        ev = check_events(events, run)
        rec = recovery(events, run, up)
        leaks = (
            sum(
                len(s["mismatch"]) + len(s["policy_left"]) + len(s["not_completed"])
                for s in (*with_pods.values(), *empty.values())
            )
            + sum(s["checkpoint"] + s["cdi_specs"] for s in empty.values())
            + len(claims)
        )
        stuck = run.never_running | run.never_gone
        if not final_ok:
            stuck |= {n for n in final if not (n in run.seen and is_running(run.seen[n]))}
        result: dict[str, Any] = {
            "pods": pods,
            "seed": seed,
            "nodes": nodes,
            "gpus": gpus,
            "concurrency": concurrency,
            "churn_s": round(churn_s, 1),
            "pods_created": run.created + keep,
            "pods_succeeded": len(run.succeeded) + (keep if final_ok else 0),
            "pods_stuck": len(stuck),
            "stuck": sorted(stuck)[:20],
            "stuck_never_running": sorted(run.never_running)[:20],
            "stuck_never_gone": sorted(run.never_gone)[:20],
            "kills": dict(Counter(t for t, _, _ in run.kills)),
            "kills_total": len(run.kills),
            "leaks": leaks,
            "claims_left": len(claims),
            "nodes_with_pods": with_pods,
            "nodes_empty": empty,
            "doubles": len(run.doubles),
            "double_samples": sorted(run.doubles)[:20],
            "events": ev["events"],
            "preparations": ev["preparations"],
            "duplicate_events": len(ev["duplicate_ids"]),
            "lost_events": len(ev["incomplete_preparations"]) + len(ev["ran_without_prepared_event"]),
            "event_problems": {k: v[:20] for k, v in ev.items() if isinstance(v, list) and v},
            "ledger_missing": len(wanted - applied),
            "ledger_extra": len({a for a in applied if a.startswith("id:")} - wanted),
            "ledger_open_uses": len(book.get("open") or {}),
            "ledger_stats": book.get("stats", {}),
            "pods_checked_for_events": len(run.claim_of),
            "preparer_kills": len([k for k in run.kills if k[0] == "preparer"]),
            "preparer_recovery_s": figures([r["from_kill"] for r in rec if "from_kill" in r]),
            "preparer_recovery_after_restart_s": figures([r["from_restart"] for r in rec if "from_restart" in r]),
            "preparer_restart_to_serving_s": figures([r["start"] for r in rec if "start" in r]),
            "preparer_recoveries": rec,
            "kill_log": [f"{time.strftime('%H:%M:%S', time.localtime(at))} {t} {n}".strip() for t, n, at in run.kills],
        }
        result["ok"] = not (
            result["pods_stuck"]
            or leaks
            or result["doubles"]
            or result["duplicate_events"]
            or result["lost_events"]
            or result["ledger_missing"]
            or result["ledger_extra"]
            or result["ledger_open_uses"]
        )
        return result
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if ledger is not None and ledger.returncode is None:
            ledger.kill()
            await ledger.wait()
        await api.close()
        await up.stop()
        if own:
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus", default="h100x4", help="--simulate spec of every node")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILLs per service (per node for node services)")
    parser.add_argument("--concurrency", type=int, default=0, help="pods alive at once (default: the GPUs)")
    parser.add_argument("--data-dir", type=Path, help="keep the cluster's state here (default: a temp dir)")
    args = parser.parse_args()
    out = asyncio.run(
        chaos(args.pods, args.seed, args.nodes, args.gpus, args.kills, args.concurrency, data_dir=args.data_dir)
    )
    print(json.dumps(out, indent=2))
    path = REPO / "bench" / "results" / "chaos.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"written to {path}")
    sys.exit(0 if out["ok"] else 1)
