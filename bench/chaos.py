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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import nats  # noqa: E402
from nats.errors import TimeoutError as NatsTimeout  # noqa: E402

from shared.kube.client import kube_api_client  # noqa: E402
from shared.kube.resources import PODS, RESOURCECLAIMS, RESOURCECLAIMTEMPLATES, Kube  # noqa: E402
from shared.kube.rest import ApiError  # noqa: E402
from shared.natsjwt import Creds  # noqa: E402

NS = "default"
LABEL = "chaos"
CLUSTER_TARGETS = ("publisher", "scheduler", "apiserver", "nats-server")
NODE_TARGETS = ("preparer", "discovery", "kubelet")
GPU_CONFIG = {
    "apiVersion": "resource.nvidia.com/v1beta1",
    "kind": "GpuConfig",
    "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
}
TEMPLATES = {
    "chaos-gpu": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]},
    "chaos-ts-gpu": {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": GPU_CONFIG}}],
    },
}
STATE_CHANGING = {"prepared", "unprepared", "rolled-back"}  # what the ledger accounts


def log(line: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {line}", flush=True)


# ---------------------------------------------------------------- the cluster, as a user runs it
class UpProcess:
    """`gpu-dra up` in its own session; its console is kept and searched as it comes."""

    def __init__(self, data_dir: Path, nodes: int, gpus: str, metrics_port: int) -> None:
        self.data_dir = data_dir
        self.kubeconfig = data_dir / "kubeconfig"
        self.argv = [
            sys.executable,
            "-m",
            "shared.cli",
            "up",
            "--nodes",
            str(nodes),
            "--gpus",
            gpus,
            "--data-dir",
            str(data_dir),
            "--metrics-port",
            str(metrics_port),
            "--no-compute-domains",
        ]
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self.stamps: list[float] = []  # wall time each line was read
        self._new = asyncio.Condition()
        self._reader: asyncio.Task[None] | None = None

    async def start(self, timeout: float) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = asyncio.create_task(self._read())
        await self.wait_line(lambda line: line.startswith("ready:"), timeout)

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            async with self._new:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self.stamps.append(time.time())
                self._new.notify_all()
        async with self._new:
            self.lines.append("\0")  # EOF
            self.stamps.append(time.time())
            self._new.notify_all()

    async def wait_line(self, match: Callable[[str], bool], timeout: float) -> str:
        async def first() -> str:
            async with self._new:
                while True:
                    for line in self.lines:
                        if line == "\0":
                            raise RuntimeError("gpu-dra up exited:\n" + "\n".join(self.lines[-40:]))
                        if match(line):
                            return line
                    await self._new.wait()

        return await asyncio.wait_for(first(), timeout)

    async def nats_url(self) -> str:
        line = await self.wait_line(lambda line: "nats-server (JetStream)" in line, 5)
        found = re.search(r"nats://\S+", line)
        assert found, line
        return found[0]

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(self.proc.wait(), 90)
            except TimeoutError:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        if self._reader is not None:
            await asyncio.wait_for(self._reader, 10)

    def pids(self, target: str, node: str = "") -> list[int]:
        """The processes of `target` (a service name, or nats-server) of this cluster, from /proc."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            text = " ".join(a.decode(errors="replace") for a in argv)
            if str(self.data_dir) not in text:
                continue
            if target == "nats-server":
                hit = argv[0].endswith(b"nats-server")
            else:
                hit = f"shared.cli {target} " in text and (not node or f"--node {node} " in text)
            if hit:
                found.append(int(entry.name))
        return found


class Api:
    """The admin's API client; remade when the API server restarted (new port token) or a call fails."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.kube: Kube | None = None

    async def call(self, what: Callable[[Kube], Any], timeout: float = 120) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.kube is None:
                    self.kube = Kube(await kube_api_client(str(self.kubeconfig)), request_timeout=10)
                return await what(self.kube)
            except ApiError as exc:
                if exc.status not in (401, 403, 429, 500, 503, 504):
                    raise
                err: Exception = exc
            except Exception as exc:  # noqa: BLE001 - connection refused/reset while the API server restarts
                err = exc
            if time.monotonic() > deadline:
                raise RuntimeError(f"the API server did not answer for {timeout:.0f}s: {err}")
            await self.close()
            await asyncio.sleep(0.3)

    async def close(self) -> None:
        if self.kube is not None:
            with contextlib.suppress(Exception):
                await self.kube.api_client.close()
            self.kube = None


# ---------------------------------------------------------------- churn, kills, samples
@dataclass
class Run:
    pods: int
    seed: int
    nodes: list[str]
    created: int = 0
    succeeded: set[str] = field(default_factory=set)
    never_running: set[str] = field(default_factory=set)
    never_gone: set[str] = field(default_factory=set)
    claim_of: dict[str, tuple[str, str]] = field(default_factory=dict)  # pod -> (claim uid, node) once Running
    kills: list[tuple[str, str, float]] = field(default_factory=list)  # (target, node, wall time)
    doubles: set[str] = field(default_factory=set)
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)  # pod name -> last listed object
    listed: asyncio.Event = field(default_factory=asyncio.Event)


SHARED_CLAIM = "chaos-shared"  # a standalone claim: pods at once share it, pods one after another re-prepare it


def pod_body(name: str, template: str) -> dict[str, Any]:
    """A pod whose claim comes from `template`, or is the standalone SHARED_CLAIM."""
    ref = {"resourceClaimName": SHARED_CLAIM} if template == SHARED_CLAIM else {"resourceClaimTemplateName": template}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {LABEL: "1"}},
        "spec": {
            "containers": [{"name": "ctr", "image": "ubuntu:22.04", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", **ref}],
        },
    }


def is_running(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []
    )


async def poll_pods(api: Api, run: Run) -> None:
    """One list of the churn's pods at a time; the workers wait on `run.listed` for news."""
    while True:
        pods, _ = await api.call(lambda k: k.list(PODS, NS, label_selector=f"{LABEL}=1"))
        run.seen = {p["metadata"]["name"]: p for p in pods}
        run.listed.set()
        run.listed = asyncio.Event()
        await asyncio.sleep(0.25)


async def until(run: Run, check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.listed.wait(), left)
    return True


async def pod_life(api: Api, run: Run, name: str, template: str, hold: float, pod_timeout: float) -> None:
    async def create(k: Kube) -> None:
        try:
            await k.create(PODS, NS, pod_body(name, template))
        except ApiError as exc:
            if exc.status != 409:  # a retry of a create that landed
                raise

    await api.call(create)
    run.created += 1
    if await until(run, lambda: name in run.seen and is_running(run.seen[name]), pod_timeout):
        run.succeeded.add(name)
        pod = run.seen[name]
        claim = (
            SHARED_CLAIM
            if template == SHARED_CLAIM
            else ((pod.get("status") or {}).get("resourceClaimStatuses") or [{}])[0].get("resourceClaimName", "")
        )
        if claim:
            with contextlib.suppress(ApiError):
                obj = await api.call(lambda k: k.get(RESOURCECLAIMS, NS, claim))
                run.claim_of[name] = (obj["metadata"]["uid"], pod["spec"].get("nodeName", ""))
        await asyncio.sleep(hold)
    else:
        run.never_running.add(name)

    async def delete(k: Kube) -> None:
        try:
            await k.delete(PODS, NS, name)
        except ApiError as exc:
            if not exc.not_found:
                raise

    await api.call(delete)
    if not await until(run, lambda: name not in run.seen, pod_timeout):
        run.never_gone.add(name)


async def churn(api: Api, run: Run, concurrency: int, pod_timeout: float, progress: asyncio.Condition) -> None:
    rng = random.Random(run.seed)
    slots = asyncio.Semaphore(concurrency)
    tasks = []

    async def one(i: int) -> None:
        try:
            template = SHARED_CLAIM if i % 5 == 4 else "chaos-ts-gpu" if i % 3 == 2 else "chaos-gpu"
            await pod_life(api, run, f"chaos-{i}", template, rng.uniform(0, 0.3), pod_timeout)
        finally:
            slots.release()

    for i in range(run.pods):
        await slots.acquire()
        tasks.append(asyncio.create_task(one(i)))
        async with progress:
            progress.notify_all()
        if (i + 1) % 50 == 0:
            log(f"{i + 1}/{run.pods} pods started, {len(run.succeeded)} ran, {len(run.kills)} kills")
    await asyncio.gather(*tasks)


def kill_schedule(run: Run, kills_each: int) -> list[tuple[float, str, str]]:
    """(fraction of the pods created, target, node) for every kill, in order; seeded."""
    rng = random.Random(run.seed * 7919 + 1)
    targets = [(t, "") for t in CLUSTER_TARGETS] + [(t, n) for n in run.nodes for t in NODE_TARGETS]
    plan = [(t, n) for t, n in targets for _ in range(kills_each)]
    rng.shuffle(plan)
    fractions = sorted(rng.uniform(0.05, 0.85) for _ in plan)
    return [(f, t, n) for f, (t, n) in zip(fractions, plan, strict=True)]


async def killer(up: UpProcess, run: Run, schedule: list[tuple[float, str, str]], progress: asyncio.Condition) -> None:
    for fraction, target, node in schedule:
        async with progress:
            await progress.wait_for(lambda f=fraction: run.created >= f * run.pods)  # type: ignore[misc]
        deadline = time.monotonic() + 60
        while not (pids := up.pids(target, node)):  # still waiting out a restart backoff
            if time.monotonic() > deadline:
                raise RuntimeError(f"{target} {node} did not come back within 60 s")
            await asyncio.sleep(0.2)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.kills.append((target, node, time.time()))
        log(f"SIGKILL {target} {node} (pid {','.join(map(str, pids))}) at pod {run.created}")


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


# ---------------------------------------------------------------- invariants
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


def admin_login(data_dir: Path) -> dict[str, Any]:
    """nats.connect options for `gpu-dra up`'s own admin identity (its NATS has no anonymous user)."""
    jwt_cb, sign_cb = Creds(admin_creds(data_dir).read_text()).callbacks()
    return {"user_jwt_cb": jwt_cb, "signature_cb": sign_cb, "inbox_prefix": "_INBOX_admin"}


def admin_creds(data_dir: Path) -> Path:
    return data_dir / "identities" / "nats" / "admin.creds"


async def stream_events(url: str, login: dict[str, Any]) -> list[dict[str, Any]]:
    nc = await nats.connect(url, **login)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe("dra.v1.claim.>", stream="DRA_EVENTS")
        out: list[dict[str, Any]] = []
        while True:
            try:
                msgs = await sub.fetch(500, timeout=2)
            except (NatsTimeout, TimeoutError):
                return out
            for msg in msgs:
                out.append(json.loads(msg.data))
                await msg.ack()
    finally:
        await nc.close()


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


async def settle(check: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout:.0f}s")
        await asyncio.sleep(0.5)


# ---------------------------------------------------------------- the run
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
        if not kill_task.done():
            kill_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
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
