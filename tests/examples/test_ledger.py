"""The third-party ledger example (examples/ledger/) against a real nats-server.

Our own Bus is the producer, as the preparer is; the ledger reads only the exported JSON Schemas
and nats-py. Totals are exact because cost is computed from the producer's timestamps.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import msgspec
import nats
import pytest

from examples.ledger.accounting import Ledger, LedgerFileError, share_fraction
from examples.ledger.consumer import LedgerService
from examples.ledger.schema import ContractError, SchemaViolation, load_contract
from examples.ledger.trust import event_key
from shared.bus import Bus
from shared.events import catalog
from shared.events.claims import ClaimLifecycle, PreparedDeviceRef, claim_event_id
from shared.events.schema import write_schemas
from tests.polling import wait_stopped

REPO = Path(__file__).resolve().parents[2]
LEDGER_DIR = REPO / "examples" / "ledger"
# Recent times: the ledger bounds body times by the server's timestamp (examples/ledger/trust.py).
T0 = time.time() - 1200.0


@pytest.fixture
def schemas(tmp_path: Path) -> Path:
    out = tmp_path / "schemas"
    write_schemas(out)  # what `gpu-dra events schema --out DIR` writes
    return out


@pytest.fixture
async def bus(nats_server) -> AsyncIterator[Bus]:
    producer = await Bus.connect(nats_server.url, name="preparer-under-test")
    await producer.provision()
    try:
        yield producer
    finally:
        await producer.nc.close()


def lifecycle(
    event: str,
    uid: str,
    namespace: str,
    at: float,
    devices: tuple[str, ...] = (),
    node: str = "node-1",
    preparation: int = 1,
) -> ClaimLifecycle:
    return ClaimLifecycle(
        event=event,  # type: ignore[arg-type]
        node=node,
        driver="gpu.nvidia.com",
        claim_uid=uid,
        claim_namespace=namespace,
        claim_name=f"claim-{uid}",
        event_id=claim_event_id(node, uid, preparation, event),
        observed_at=at,
        devices=[PreparedDeviceRef(request="gpu", pool=node, device=d, uuid=f"GPU-{d}") for d in devices],
    )


async def publish(bus: Bus, events: list[ClaimLifecycle]) -> None:
    for ev in events:
        await bus.publish(
            catalog.CLAIM, ev, msg_id=ev.event_id, namespace=ev.claim_namespace, node=ev.node, event=ev.event
        )


# team-a: 2 GPUs x 100 s + 1 GPU x 40 s = 240; team-b: one 1g10gb MIG device x 30 s, one GPU open.
FIRST_HALF = [
    lifecycle("prepare-started", "a1", "team-a", T0),
    lifecycle("prepared", "a1", "team-a", T0, ("gpu-0", "gpu-1")),
    lifecycle("prepared", "b1", "team-b", T0 + 10, ("gpu-2-mig-1g10gb-19-0",)),
    lifecycle("prepare-failed", "a9", "team-a", T0 + 11),
]
SECOND_HALF = [
    lifecycle("unprepared", "a1", "team-a", T0 + 100),
    lifecycle("unprepared", "b1", "team-b", T0 + 40),
    lifecycle("prepared", "a2", "team-a", T0 + 200, ("gpu-3",)),
    lifecycle("unprepared", "a2", "team-a", T0 + 240),
    lifecycle("prepared", "b2", "team-b", T0 + 300, ("gpu-4",)),
]
ALL_EVENTS = FIRST_HALF + SECOND_HALF
STATE_CHANGING = sum(1 for e in ALL_EVENTS if e.event in ("prepared", "unprepared"))


def test_each_preparation_of_one_claim_is_accounted_and_each_resend_once() -> None:
    """A standalone claim used by three pods one after another: three preparations, three uses."""
    ledger = Ledger()
    events = [
        lifecycle(kind, "s1", "team-a", T0 + 100 * p + (10 if kind == "unprepared" else 0), ("gpu-0",), preparation=p)
        for p in (1, 2, 3)
        for kind in ("prepared", "unprepared")
    ]
    for ev in events + events:  # every event delivered twice (a resend after a restart)
        ledger.apply(msgspec.to_builtins(ev), event_key(msgspec.to_builtins(ev), ev.node, 0))
    assert ledger.stats.applied == 6 and ledger.stats.duplicates == 6
    assert ledger.report()["team-a"]["claims_closed"] == 3
    assert ledger.report()["team-a"]["gpu_seconds"] == 30.0


def test_keys_are_forgotten_once_older_than_the_retention_also_after_a_reload() -> None:
    ledger = Ledger(retention_s=100)

    def apply(ledger: Ledger, ev: ClaimLifecycle) -> str:
        body = msgspec.to_builtins(ev)
        key = event_key(body, ev.node, 0)
        ledger.apply(body, key)
        return key

    late = apply(ledger, lifecycle("prepared", "c2", "team-a", T0 + 50, ("gpu-1",)))
    early = apply(ledger, lifecycle("prepared", "c1", "team-a", T0, ("gpu-0",)))  # delivered after a later one
    assert set(ledger.applied) == {early, late}
    ledger = Ledger.from_json(json.loads(json.dumps(ledger.to_json())), 100)
    newest = apply(ledger, lifecycle("unprepared", "c1", "team-a", T0 + 120))  # horizon T0 + 20: c1's prepare goes
    assert set(ledger.applied) == {late, newest}
    apply(ledger, lifecycle("unprepared", "c2", "team-a", T0 + 151))  # horizon T0 + 51: c2's prepare goes too
    assert late not in ledger.applied and newest in ledger.applied
    assert ledger.report()["team-a"]["gpu_seconds"] == 120.0 + 101.0


def share(
    uid: str, namespace: str, event: str, at: float, device: str = "gpu-0", node: str = "node-1", **consumed: str
) -> ClaimLifecycle:
    """A claim holding one share of `device` (an 80Gi GPU) consuming `consumed` of it."""
    ev = lifecycle(event, uid, namespace, at, (device,), node=node)
    ev.devices[0].share_id = f"share-{uid}"
    ev.devices[0].consumed_capacity = dict(consumed)
    ev.devices[0].capacity = {"memory": "80Gi", **({"compute": "100"} if "compute" in consumed else {})}
    return ev


# two tenants' shares of gpu-0 (10Gi of 80Gi each) for 100 s, and a whole gpu-1 for 100 s
SHARED_GPU = [
    share("s1", "team-a", "prepared", T0, memory="10Gi", compute="10"),
    share("s2", "team-b", "prepared", T0, memory="10Gi", compute="40"),
    lifecycle("prepared", "w1", "team-a", T0, ("gpu-1",)),
    share("s1", "team-a", "unprepared", T0 + 100, memory="10Gi", compute="10"),
    share("s2", "team-b", "unprepared", T0 + 100, memory="10Gi", compute="40"),
    lifecycle("unprepared", "w1", "team-a", T0 + 100, ("gpu-1",)),
]


def test_two_shares_of_one_gpu_bill_their_fraction_and_a_whole_gpu_bills_as_before() -> None:
    ledger = Ledger()
    for ev in SHARED_GPU:
        body = msgspec.to_builtins(ev)
        ledger.apply(body, event_key(body, ev.node, 0))
    report = ledger.report()
    # 10Gi / 80Gi x 100 s = 12.5 GPU-share-seconds each (memory wins over compute); the whole GPU: 100 s
    assert (report["team-a"]["gpu_share_seconds"], report["team-a"]["gpu_seconds"]) == (12.5, 100.0)
    assert (report["team-b"]["gpu_share_seconds"], report["team-b"]["gpu_seconds"]) == (12.5, 0.0)
    assert ledger.report(now=T0 + 50)["team-a"].get("running_gpu_share_seconds") == 0.0


def test_an_open_share_runs_at_its_fraction_and_survives_a_save() -> None:
    ledger = Ledger()
    body = msgspec.to_builtins(share("s1", "team-a", "prepared", T0, memory="20Gi"))
    ledger.apply(body, event_key(body, "node-1", 0))
    again = Ledger.from_json(json.loads(json.dumps(ledger.to_json())), 7 * 24 * 3600)
    assert again.report(now=T0 + 40)["team-a"]["running_gpu_share_seconds"] == 10.0  # 20/80 x 40 s
    assert again.report(now=T0 + 40)["team-a"]["running_gpu_seconds"] == 0.0
    older = json.loads(json.dumps(ledger.to_json()))  # a ledger file from before shares: no fractions
    del older["open"]["s1@node-1"]["fractions"]
    assert Ledger.from_json(older, 60.0).report(now=T0 + 40)["team-a"]["running_gpu_seconds"] == 40.0


@pytest.mark.parametrize(
    ("consumed", "capacity", "fraction"),
    [
        ({"memory": "10Gi", "compute": "50"}, {"memory": "80Gi", "compute": "100"}, 0.125),  # memory first
        ({"memory": "10Gi", "compute": "50"}, {}, 0.5),  # GPU memory unknown: compute percent / 100
        ({"memory": "0", "compute": "25"}, {"memory": "80Gi"}, 0.25),  # memoryDefault none: no memory taken
        ({"memory": "0", "shares": "1"}, {"memory": "80Gi", "shares": "4"}, 0.25),  # 1/N
        ({"shares": "1"}, {}, 1.0),  # N unknown: the whole GPU
        ({}, {}, 1.0),
        ({"memory": "100Gi"}, {"memory": "80Gi"}, 1.0),  # never more than the device
        ({"memory": "10G"}, {"memory": "80G"}, 0.125),
    ],
)
def test_a_shares_fraction_follows_the_documented_order(consumed: dict, capacity: dict, fraction: float) -> None:
    assert (
        share_fraction({"device": "gpu-0", "share_id": "s", "consumed_capacity": consumed, "capacity": capacity})
        == fraction
    )
    assert share_fraction({"device": "gpu-0", "consumed_capacity": consumed}) is None  # not a share


async def test_shares_are_billed_from_the_stream(nats_server, bus: Bus, schemas: Path, tmp_path: Path) -> None:
    await publish(bus, SHARED_GPU)
    svc = service(nats_server, schemas, tmp_path / "ledger.json")
    await run_until(svc, lambda lg: lg.stats.applied == len(SHARED_GPU))
    assert svc.ledger.stats.rejected == 0  # share fields pass the published schema
    saved = json.loads((tmp_path / "ledger.json").read_text())["namespaces"]
    assert (saved["team-a"]["gpu_share_seconds"], saved["team-a"]["gpu_seconds"]) == (12.5, 100.0)
    assert saved["team-b"]["gpu_share_seconds"] == 12.5


def assert_exact_totals(ledger: Ledger) -> None:
    report = ledger.report(now=T0 + 310)
    assert report == {
        "team-a": {
            "gpu_seconds": 240.0,
            "mig_seconds": {},
            "gpu_share_seconds": 0.0,
            "claims_closed": 2,
            "claims_open": 0,
            "running_gpu_seconds": 0.0,
            "running_gpu_share_seconds": 0.0,
        },
        "team-b": {
            "gpu_seconds": 0.0,
            "mig_seconds": {"1g10gb": 30.0},
            "gpu_share_seconds": 0.0,
            "claims_closed": 1,
            "claims_open": 1,
            "running_gpu_seconds": 10.0,
            "running_gpu_share_seconds": 0.0,
        },
    }


def service(nats_server, schemas: Path, state: Path, **options) -> LedgerService:
    return LedgerService(nats_server.url, load_contract(schemas), state, **options)


async def run_until(svc: LedgerService, predicate, timeout: float = 15.0) -> None:
    await svc.start()
    task = asyncio.create_task(svc.run())
    try:
        await svc.wait_until(predicate, timeout)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await svc.close()


async def test_exact_totals_per_namespace(nats_server, bus: Bus, schemas: Path, tmp_path: Path) -> None:
    await publish(bus, ALL_EVENTS)
    svc = service(nats_server, schemas, tmp_path / "ledger.json")
    await run_until(svc, lambda lg: lg.stats.applied == STATE_CHANGING)
    assert_exact_totals(svc.ledger)
    assert svc.ledger.stats.ignored == 2  # prepare-started, prepare-failed
    saved = json.loads((tmp_path / "ledger.json").read_text())
    assert saved["namespaces"]["team-a"]["gpu_seconds"] == 240.0


async def test_restart_mid_stream_counts_each_event_once(nats_server, bus: Bus, schemas: Path, tmp_path: Path) -> None:
    state = tmp_path / "ledger.json"
    await publish(bus, FIRST_HALF)
    first = service(nats_server, schemas, state)
    await run_until(first, lambda lg: lg.stats.applied == 2)
    assert first.ledger.report()["team-a"]["claims_open"] == 1

    await publish(bus, SECOND_HALF)  # while the ledger is down
    second = service(nats_server, schemas, state)
    await run_until(second, lambda lg: lg.stats.applied == STATE_CHANGING)
    assert_exact_totals(second.ledger)
    assert second.ledger.stats.duplicates == 0  # the durable consumer resumed after the acked ones


async def test_crash_between_write_and_ack_is_not_double_counted(
    nats_server, bus: Bus, schemas: Path, tmp_path: Path
) -> None:
    state = tmp_path / "ledger.json"
    await publish(bus, ALL_EVENTS)

    async def crash(_msgs) -> None:
        raise RuntimeError("simulated crash after the ledger file was written")

    doomed = service(nats_server, schemas, state, ack_wait_s=1.0, after_persist=crash)
    await doomed.start()
    with pytest.raises(RuntimeError, match="simulated crash"):
        await doomed.run()
    await doomed.close()
    assert_exact_totals(await_load(state))  # written, never acked

    survivor = service(nats_server, schemas, state, ack_wait_s=1.0)
    await run_until(survivor, lambda lg: lg.stats.duplicates == STATE_CHANGING)  # redelivered after ack_wait
    assert_exact_totals(survivor.ledger)
    assert survivor.ledger.stats.applied == STATE_CHANGING


async def test_a_nats_stalled_before_a_batchs_acks_are_confirmed_is_waited_out_not_fatal(
    nats_server, bus: Bus, schemas: Path, tmp_path: Path
) -> None:
    """nats-server stopped (SIGSTOP) between the ledger's write and its acks, for longer than the acks may take to
    be confirmed, as a loaded or restarting NATS does in the chaos run: the ledger counts the batch unconfirmed and
    goes on, and once NATS answers again it accounts what comes next, every event exactly once."""
    state = tmp_path / "ledger.json"
    await publish(bus, FIRST_HALF)
    stalled: list[bool] = []

    async def stall_nats(_msgs) -> None:
        if not stalled:
            stalled.append(True)
            os.kill(nats_server.proc.pid, signal.SIGSTOP)
            # stopped before the acks go: a thread still running could confirm them (1 run in ~30 did)
            assert await asyncio.to_thread(wait_stopped, nats_server.proc.pid), "nats-server did not stop"

    svc = service(nats_server, schemas, state, ack_wait_s=1.0, ack_timeout_s=0.5, after_persist=stall_nats)
    await svc.start()
    task = asyncio.create_task(svc.run())
    try:
        ended = asyncio.create_task(svc.wait_until(lambda _ledger: svc.unconfirmed_batches > 0, 30))
        await asyncio.wait([task, ended], return_when=asyncio.FIRST_COMPLETED)
        assert not task.done(), task.exception()
        await ended
        os.kill(nats_server.proc.pid, signal.SIGCONT)
        await publish(bus, SECOND_HALF)
        await svc.wait_until(lambda lg: lg.stats.applied == STATE_CHANGING, 30)
        assert not task.done(), task
        assert_exact_totals(svc.ledger)
    finally:
        os.kill(nats_server.proc.pid, signal.SIGCONT)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await svc.close()


async def test_a_cancellation_that_a_fetch_swallowed_still_ends_the_ledger(
    nats_server, bus: Bus, schemas: Path, tmp_path: Path
) -> None:
    """Python 3.11's wait_for can return its result to a task that was cancelled meanwhile, dropping the
    cancellation (nats-py's fetch waits that way): the ledger's loop still ends, so whoever cancelled it
    (a SIGTERM, a test's teardown) is not left waiting for ever."""
    svc = service(nats_server, schemas, tmp_path / "ledger.json")
    await svc.start()
    real = svc._sub
    fetching = asyncio.Event()

    class Swallowing:  # a fetch that is cancelled as it returns: it returns (nothing), as wait_for may
        async def fetch(self, batch: int, timeout: float) -> list:
            fetching.set()
            try:
                await asyncio.sleep(timeout)
            except asyncio.CancelledError:
                return []
            return []

    svc._sub = Swallowing()
    task = asyncio.create_task(svc.run())
    try:
        await fetching.wait()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=10)
        assert task in done and task.cancelled()
    finally:
        svc._sub = real
        task.cancel()
        await asyncio.wait([task], timeout=5)  # the code before never ends here: not waited for ever
        await svc.close()


def await_load(state: Path) -> Ledger:
    return Ledger.from_json(json.loads(state.read_text()), 7 * 24 * 3600)


async def test_full_replay_with_kept_ledger_changes_nothing_and_lost_ledger_rebuilds(
    nats_server, bus: Bus, schemas: Path, tmp_path: Path
) -> None:
    state = tmp_path / "ledger.json"
    await publish(bus, ALL_EVENTS)
    await run_until(service(nats_server, schemas, state), lambda lg: lg.stats.applied == STATE_CHANGING)

    replay = service(nats_server, schemas, state, durable="ledger-replay")  # a new consumer reads from seq 1
    await run_until(replay, lambda lg: lg.stats.duplicates == STATE_CHANGING)
    assert_exact_totals(replay.ledger)

    rebuilt = service(nats_server, schemas, tmp_path / "fresh.json", durable="ledger-rebuild")
    await run_until(rebuilt, lambda lg: lg.stats.applied == STATE_CHANGING)
    assert_exact_totals(rebuilt.ledger)


async def test_messages_that_break_the_schema_are_skipped_without_blocking(
    nats_server, bus: Bus, schemas: Path, tmp_path: Path
) -> None:
    raw = await nats.connect(nats_server.url)
    js = raw.jetstream()
    await js.publish("dra.v1.claim.team-a.node-1.prepared", b"not json")
    await js.publish("dra.v1.claim.team-a.node-1.prepared", json.dumps({"event": "prepared"}).encode())
    await js.publish(
        "dra.v1.claim.team-a.node-1.prepared",
        json.dumps(
            {
                "event": "paused",
                "node": "n",
                "driver": "d",
                "claim_uid": "u",
                "claim_namespace": "team-a",
                "claim_name": "c",
            }
        ).encode(),
    )
    await raw.close()
    await publish(bus, ALL_EVENTS)
    svc = service(nats_server, schemas, tmp_path / "ledger.json")
    await run_until(svc, lambda lg: lg.stats.applied == STATE_CHANGING)
    assert svc.ledger.stats.rejected == 3
    assert_exact_totals(svc.ledger)


async def test_namespace_scope_accounts_only_that_namespace(
    nats_server, bus: Bus, schemas: Path, tmp_path: Path
) -> None:
    await publish(bus, ALL_EVENTS)
    svc = service(nats_server, schemas, tmp_path / "ledger.json", namespace="team-b", durable="team-b-only")
    assert svc.filter_subject == "dra.v1.claim.team-b.*.*"
    await run_until(svc, lambda lg: lg.stats.applied == 3)
    assert set(svc.ledger.report()) == {"team-b"}


def test_contract_comes_from_the_exported_index(schemas: Path, tmp_path: Path) -> None:
    contract = load_contract(schemas)
    assert contract.filter_subject == "dra.v1.claim.*.*.*"
    assert contract.stream == "DRA_EVENTS"
    assert contract.retention_s == catalog.EVENTS_STREAM.max_age_s
    with pytest.raises(ContractError, match="gpu-dra events schema --out"):
        load_contract(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "message",
    [
        {"event": "prepared"},
        {"event": "paused", "node": "n", "driver": "d", "claim_uid": "u", "claim_namespace": "ns", "claim_name": "c"},
        {"event": "prepared", "node": 3, "driver": "d", "claim_uid": "u", "claim_namespace": "ns", "claim_name": "c"},
        {
            "event": "prepared",
            "node": "n",
            "driver": "d",
            "claim_uid": "u",
            "claim_namespace": "ns",
            "claim_name": "c",
            "devices": [{"request": "gpu", "pool": "p"}],
        },
        {
            "event": "prepared",
            "node": "n",
            "driver": "d",
            "claim_uid": "u",
            "claim_namespace": "ns",
            "claim_name": "c",
            "devices": [{"request": "gpu", "pool": "p", "device": "gpu-0"}],
            "observed_at": 12.5,
        },
        {
            "event": "prepared",
            "node": "n",
            "driver": "d",
            "claim_uid": "u",
            "claim_namespace": "ns",
            "claim_name": "c",
            "devices": [
                {
                    "request": "gpu",
                    "pool": "p",
                    "device": "gpu-0",
                    "share_id": "s",
                    "consumed_capacity": {"memory": "10Gi"},
                    "capacity": {"memory": "80Gi"},
                }
            ],
        },
        {
            "event": "prepared",
            "node": "n",
            "driver": "d",
            "claim_uid": "u",
            "claim_namespace": "ns",
            "claim_name": "c",
            "devices": [{"request": "gpu", "pool": "p", "device": "gpu-0", "consumed_capacity": {"memory": 10}}],
        },
    ],
)
def test_schema_checker_agrees_with_jsonschema(schemas: Path, message: dict) -> None:
    contract = load_contract(schemas)
    try:
        jsonschema.validate(message, contract.schema)
        expected_valid = True
    except jsonschema.ValidationError:
        expected_valid = False
    try:
        contract.check(message)
        valid = True
    except SchemaViolation:
        valid = False
    assert valid == expected_valid


async def test_corrupt_ledger_file_stops_start_and_is_left_alone(
    nats_server, bus: Bus, schemas: Path, tmp_path: Path
) -> None:
    state = tmp_path / "ledger.json"
    state.write_text('{"version": 1, "namespaces": ')
    svc = service(nats_server, schemas, state)
    with pytest.raises(LedgerFileError, match="move it aside"):
        await svc.start()
    assert state.read_text() == '{"version": 1, "namespaces": '


def _imports(path: Path) -> set[str]:
    """The modules `path` imports (absolute imports, full dotted names)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module or "")
    return names


def test_the_example_imports_only_the_standard_library_nats_and_the_billing_rule() -> None:
    """A third party needs nats-py, the published schemas and the two standard-library files of the billing
    rule the fleet page shares (shared/billing.py, shared/quantity.py), nothing else of the project."""
    stdlib = set(sys.stdlib_module_names)
    shared_rule = {"shared.billing", "shared.quantity"}
    for module in LEDGER_DIR.glob("*.py"):
        for name in _imports(module):
            root = name.split(".")[0]
            assert root in stdlib | {"nats"} or name in shared_rule, f"{module.name} imports {name}"
    for name in shared_rule:
        path = REPO / (name.replace(".", "/") + ".py")
        for imported in _imports(path):
            assert imported.split(".")[0] in stdlib or imported in shared_rule, f"{path.name} imports {imported}"


async def test_runs_as_a_process_and_prints_the_report_on_sigterm(
    nats_server, bus: Bus, schemas: Path, tmp_path: Path
) -> None:
    await publish(bus, ALL_EVENTS)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "examples.ledger",
        "--schemas",
        str(schemas),
        "--nats",
        nats_server.url,
        "--state",
        str(tmp_path / "ledger.json"),
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(20):
            assert proc.stderr is not None
            while True:
                line = (await proc.stderr.readline()).decode()
                assert line, "the ledger exited before catching up"
                if "caught up" in line:
                    break
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
    report = json.loads(out)
    assert report["team-a"]["gpu_seconds"] == 240.0
    assert report["team-b"]["mig_seconds"] == {"1g10gb": 30.0}


async def test_an_idle_stream_is_waited_out_not_fatal(nats_server, bus: Bus, schemas: Path, tmp_path: Path) -> None:
    """fetch() on an idle stream times out every `fetch_timeout_s`; nats-py raises its own TimeoutError or,
    when the deadline runs out between its two pull requests, asyncio's. Neither may end the ledger."""
    svc = service(nats_server, schemas, tmp_path / "ledger.json", fetch_timeout_s=0.005)
    await svc.start()
    task = asyncio.create_task(svc.run())
    try:
        idle = asyncio.ensure_future(svc.wait_until(lambda lg: svc.idle_fetches >= 200, timeout=30))
        await asyncio.wait({task, idle}, return_when=asyncio.FIRST_COMPLETED)
        assert not task.done(), f"the ledger stopped on an idle stream: {task.exception()!r}"
        await idle
        await publish(bus, ALL_EVENTS)  # and it still consumes afterwards
        await svc.wait_until(lambda lg: lg.stats.applied == STATE_CHANGING, timeout=15)
        assert not task.done()
        assert_exact_totals(svc.ledger)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await svc.close()
