"""The chaos run's invariants (bench/chaos.py, issue 16, item 7): a node's checkpoint entries vs its CDI
claim specs vs the claims prepared there, and sharing policy left on a free GPU (leaks); a device held
by two claims, sampled throughout the churn (doubles); every event once and every preparation complete
in DRA_EVENTS (duplicates, losses); and the time from a preparer kill to that node's next `prepared`
(recovery)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import re
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from bench.chaos_churn import Run
from bench.chaos_cluster import NS, Api, UpProcess
from shared.kube.resources import RESOURCECLAIMS

STATE_CHANGING = {"prepared", "unprepared", "rolled-back"}  # what the ledger accounts


def read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def checkpoint(up: UpProcess, node: str) -> dict[str, Any]:
    path = up.data_dir / "nodes" / node / "var/lib/kubelet/plugins/gpu.nvidia.com/checkpoint.json"
    return dict(read_json(path).get("preparedClaims") or {})


def doubles_in_checkpoint(entries: dict[str, Any]) -> list[str]:
    holders: dict[str, list[tuple[str, bool]]] = defaultdict(list)
    for uid, record in entries.items():
        for d in record.get("devices") or []:
            holders[f"{d.get('pool')}/{d.get('device')}"].append((uid, bool(d.get("shared"))))
    return [
        f"{dev}: {sorted(u for u, _ in held)}"
        for dev, held in holders.items()
        if len(held) > 1 and not all(shared for _, shared in held)
    ]


def doubles_in_allocations(claims: list[dict[str, Any]]) -> list[str]:
    holders: dict[str, list[str]] = defaultdict(list)
    for c in claims:
        for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
            if not r.get("adminAccess"):
                holders[f"{r.get('pool')}/{r.get('device')}"].append(c["metadata"]["uid"])
    return [f"{dev}: {sorted(uids)}" for dev, uids in holders.items() if len(uids) > 1]


async def sample_doubles(up: UpProcess, api: Api, run: Run) -> None:
    while True:
        for node in run.nodes:
            run.doubles.update(f"checkpoint {node} {d}" for d in doubles_in_checkpoint(checkpoint(up, node)))
        claims, _ = await api.call(lambda k: k.list(RESOURCECLAIMS, NS))
        run.doubles.update(f"allocation {d}" for d in doubles_in_allocations(claims))
        await asyncio.sleep(1.0)


def node_state(up: UpProcess, node: str, claims: list[dict[str, Any]], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """Checkpoint entries vs CDI claim specs vs claims prepared on the node, and sharing left on free GPUs."""
    entries = checkpoint(up, node)
    root = up.data_dir / "nodes" / node
    specs = {m[1] for p in (root / "var/run/cdi").glob("*.json") if (m := re.search(r"claim_(.+)\.json$", p.name))}
    pods_here = {p["metadata"]["uid"] for p in pods if p["spec"].get("nodeName") == node}
    on_node = {
        c["metadata"]["uid"]
        for c in claims
        if (c.get("status") or {}).get("allocation")
        and {r.get("uid") for r in (c.get("status") or {}).get("reservedFor") or []} & pods_here
    }
    sim = read_json(root / f"var/lib/gpu-dra/simnvml-{node}.json")
    held = {d.get("uuid") for e in entries.values() for d in e.get("devices") or []} | {
        d.get("parent_uuid") for e in entries.values() for d in e.get("devices") or []
    }
    policy_left = [
        f"{g['uuid']} timeslice={g.get('timeslice', 0)} compute_mode={g.get('compute_mode', 0)}"
        for g in sim.get("gpus") or []
        if (g.get("timeslice") or g.get("compute_mode")) and g["uuid"] not in held
    ]
    policy_left += [
        f"MPS daemon {d}" for d, m in (sim.get("mps") or {}).items() if not set(m.get("gpu_uuids") or []) & held
    ]
    keys = set(entries)
    policy_held = sum(1 for g in sim.get("gpus") or [] if g.get("timeslice") and g["uuid"] in held)
    return {
        "checkpoint": len(entries),
        "cdi_specs": len(specs),
        "prepared_claims": len(on_node),
        "timesliced_held": policy_held,
        "mismatch": sorted((keys ^ specs) | (keys ^ on_node)),
        "policy_left": policy_left,
        "not_completed": sorted(u for u, e in entries.items() if e.get("state") != "PrepareCompleted"),
    }


def check_events(events: list[dict[str, Any]], run: Run) -> dict[str, Any]:
    ids = Counter(e.get("event_id", "") for e in events)
    duplicates = sorted(i for i, n in ids.items() if n > 1)
    preparations: dict[str, set[str]] = defaultdict(set)
    for e in events:
        parts = str(e.get("event_id", "")).split("/")
        if len(parts) == 4:
            preparations["/".join(parts[:3])].add(parts[3])
    incomplete = []
    for prep, kinds in preparations.items():
        done = (
            ("prepared" in kinds and ({"unprepared", "rolled-back"} & kinds))
            or ("rolled-back" in kinds)
            or kinds == {"prepare-failed"}
        )
        if "prepare-started" not in kinds and kinds != {"prepare-failed"}:
            done = False
        if not done:
            incomplete.append(f"{prep}: {sorted(kinds)}")
    prepared = {(e["claim_uid"], e["node"]) for e in events if e.get("event") == "prepared"}
    unaccounted = sorted(
        f"{pod} {uid}@{node}" for pod, (uid, node) in run.claim_of.items() if (uid, node) not in prepared
    )
    return {
        "events": len(events),
        "preparations": len(preparations),
        "duplicate_ids": duplicates,
        "incomplete_preparations": sorted(incomplete),
        "ran_without_prepared_event": unaccounted,
        "no_event_id": ids.get("", 0),
    }


def serving_times(up: UpProcess, node: str) -> list[float]:
    """When the node's GPU preparer said "preparer serving" (its log), as wall times."""
    out = []
    with contextlib.suppress(OSError):
        for line in (up.data_dir / "logs" / f"{node}-preparer.log").read_text().splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if entry.get("msg") == "preparer serving" and entry.get("driver") == "gpu.nvidia.com":
                    stamp = datetime.datetime.fromisoformat(entry["ts"].replace("Z", "+00:00"))
                    out.append(stamp.timestamp())
    return out


def recovery(events: list[dict[str, Any]], run: Run, up: UpProcess) -> list[dict[str, Any]]:
    """Per preparer kill, seconds: to the node's next `prepared` from the kill (`from_kill`) and from the
    restart (`up` prints "<node>-preparer restarted"), and the restarted preparer's start (restart to its
    log's "preparer serving")."""
    prepared = sorted((e["observed_at"], e["node"]) for e in events if e.get("event") == "prepared")
    out: list[dict[str, Any]] = []
    for target, node, at in run.kills:
        if target != "preparer":
            continue
        one: dict[str, Any] = {"node": node, "at": time.strftime("%H:%M:%S", time.localtime(at))}
        out.append(one)
        nxt = next((t for t, n in prepared if n == node and t > at), None)
        if nxt is None:
            continue
        one["from_kill"] = round(nxt - at, 2)
        restarted = next(
            (
                t
                for t, line in zip(up.stamps, up.lines, strict=False)
                if t > at and f"{node}-preparer restarted" in line
            ),
            None,
        )
        if restarted is None or restarted > nxt:
            continue
        one["from_restart"] = round(nxt - restarted, 2)
        serving = next((t for t in serving_times(up, node) if t > at), None)
        if serving is not None:
            one["start"] = round(serving - restarted, 2)
    return out


def figures(values: list[float]) -> dict[str, Any]:
    return {
        "measured": len(values),
        "median": round(statistics.median(values), 2) if values else None,
        "max": round(max(values), 2) if values else None,
    }
