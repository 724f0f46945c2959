"""No claim event lost: ids unique per preparation, a durable outbox, and a `prepare-failed` for every failed
prepare. Real sockets, a real nats-server with the DRA_EVENTS stream, and (for the crash) a real
`gpu-dra preparer` process killed with SIGKILL while NATS is down."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
from collections import Counter
from pathlib import Path

import jsonschema
import msgspec
import pytest
from prometheus_client import REGISTRY

from embedded.apiserver.testing import running_apiserver
from embedded.kubelet.client import register
from services.preparer.host import outbox as outbox_module
from services.preparer.host.checkpoint import ClaimRecord, PreparedDevice
from services.preparer.host.lifecycle import LifecycleEvents
from shared.bus import Bus
from shared.events.claims import ClaimLifecycle
from shared.events.schema import write_schemas
from shared.natsserver import EmbeddedNats
from tests.preparer.helpers import ApiClaims, MemoryClaims, claim_doc, gpu_config, running_node, send_all
from tests.preparer.test_crash import start_preparer, wait_for_socket

SUBJECTS = "dra.v1.claim.>"


@pytest.fixture
def dev_root(root: Path) -> Path:
    dev = root / "host" / "dev"
    dev.mkdir(parents=True)
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        (dev / name).touch()
    return root / "host"


async def stored_count(bus: Bus) -> int:
    info = await bus.js.stream_info("DRA_EVENTS", subjects_filter=SUBJECTS)
    return sum((info.state.subjects or {}).values())


async def stream_events(bus: Bus, want: int, timeout: float = 20.0) -> list[ClaimLifecycle]:
    """The claim events in DRA_EVENTS once it holds `want` of them (and exactly that many)."""
    sub = await bus.js.subscribe(SUBJECTS, ordered_consumer=True)
    try:
        out = [
            msgspec.json.decode((await sub.next_msg(timeout=timeout)).data, type=ClaimLifecycle) for _ in range(want)
        ]
    finally:
        await sub.unsubscribe()
    assert await stored_count(bus) == want
    return out


async def test_three_preparations_of_one_claim_keep_three_pairs_of_events(
    bus: Bus, claims: MemoryClaims, root: Path, dev_root: Path
) -> None:
    claim = claims.add(claim_doc(name="standalone", results=[("gpu", "gpu-1")]))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        node.service.events.attach(bus)
        for _ in range(3):  # three pods one after another
            assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
            assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        await node.service.events.drained()
        seq_on_disk = json.loads(node.service.checkpoint.path.read_text())["preparationSeq"]
    events = await stream_events(bus, 9)
    assert [e.event for e in events] == ["prepare-started", "prepared", "unprepared"] * 3
    assert len({e.event_id for e in events}) == 9
    preparations = [int(e.event_id.split("/")[2]) for e in events]
    assert preparations[0] < preparations[3] < preparations[6] == seq_on_disk  # one per preparation, persisted
    assert all(p == preparations[i - i % 3] for i, p in enumerate(preparations))  # a pair shares its number
    assert all(e.event_id.startswith(f"n1/{claim.uid}/") for e in events)
    # the counter survives unprepare and a restart: the next preparation gets a new number
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        assert node.service.checkpoint.claims[claim.uid].preparation == seq_on_disk + 1


async def test_claims_events_go_out_in_rounds_each_claims_in_order(
    bus: Bus, claims: MemoryClaims, root: Path, dev_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four claims prepared and unprepared while NATS is away leave 12 events; once it is there they go in
    three rounds (each claim's first event, then its second, then its third), every round's events in
    flight together, and the stream holds each claim's events in their order."""
    ours = [claims.add(claim_doc(name=f"c{i}", results=[("gpu", "gpu-1")])) for i in range(4)]
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        for claim in ours:
            assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
            assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        events = node.service.events
        rounds: list[int] = []
        send_round = events._send_round

        async def counted(batch: list[tuple[int, outbox_module.OutboxRecord]]) -> list[int]:
            rounds.append(len(batch))
            return await send_round(batch)

        monkeypatch.setattr(events, "_send_round", counted)
        events.attach(bus)
        await events.drained()
    assert rounds == [4, 4, 4]
    stored = await stream_events(bus, 12)
    for claim in ours:
        assert [e.event for e in stored if e.claim_uid == claim.uid] == ["prepare-started", "prepared", "unprepared"]


async def test_a_retry_after_a_rollback_gets_new_ids_and_a_resend_keeps_its_own(
    bus: Bus, claims: MemoryClaims, root: Path, dev_root: Path
) -> None:
    claim = claims.add(claim_doc(name="retried", results=[("gpu", "gpu-0")]))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        checkpoint = node.service.checkpoint
        interrupted = ClaimRecord(
            state="PrepareStarted",
            name=claim.name,
            namespace=claim.namespace,
            preparation=checkpoint.next_preparation(),
            devices=[PreparedDevice(requests=["gpu"], pool="n1", device="gpu-0")],
        )
        await checkpoint.put(claim.uid, interrupted)
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        outbox = checkpoint.path.with_name("outbox.jsonl")
        before_sending = outbox.read_bytes()
        node.service.events.attach(bus)
        await node.service.events.drained()
    events = await stream_events(bus, 3)
    assert [e.event for e in events] == ["rolled-back", "prepare-started", "prepared"]
    assert events[0].event_id == f"n1/{claim.uid}/{interrupted.preparation}/rolled-back"
    assert events[1].event_id == f"n1/{claim.uid}/{interrupted.preparation + 1}/prepare-started"
    # a process that died after sending but before noting the acks sends the same events again on
    # restart: with the message ids it stored, so JetStream keeps each once
    outbox.write_bytes(before_sending)
    again = LifecycleEvents("n1", "gpu.nvidia.com", outbox)
    assert await again.outbox.load() == 3
    await send_all(again, bus)
    assert again.sent == 3 and await stored_count(bus) == 3
    assert await LifecycleEvents("n1", "gpu.nvidia.com", outbox).outbox.load() == 0  # all acked on file


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("missing", "not-found"),
        ("unallocated", "not-allocated"),
        ("elsewhere", "other-node"),
        ("bad-config", "invalid-config"),
        ("busy", "device-busy"),
    ],
)
async def test_every_failed_prepare_records_prepare_failed_with_its_reason(
    case: str, reason: str, claims: MemoryClaims, root: Path, dev_root: Path
) -> None:
    holder = claims.add(claim_doc(name="holder", results=[("gpu", "gpu-1")]))
    if case == "missing":
        claim = claims.add(claim_doc(name="gone", results=[("gpu", "gpu-0")]))
        claims.delete(claim.namespace, claim.name)
    elif case == "unallocated":
        doc = claim_doc(name="new", results=[("gpu", "gpu-0")])
        doc["status"] = {}
        claim = claims.add(doc)
    elif case == "elsewhere":
        claim = claims.add(claim_doc(name="there", results=[("gpu", "gpu-0")], node="n2"))
    elif case == "bad-config":
        claim = claims.add(
            claim_doc(name="bad", results=[("gpu", "gpu-0")], configs=[gpu_config({"strategy": "Nonsense"})])
        )
    else:
        claim = claims.add(claim_doc(name="second", results=[("gpu", "gpu-1")]))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        assert (await node.plugin.prepare([holder]))[holder.uid].error == ""
        for _ in range(2):  # the kubelet retries: each attempt has its own event
            assert (await node.plugin.prepare([claim]))[claim.uid].error
        failed = [e for e in node.service.events.pending if e.claim_uid == claim.uid]
        assert [(e.event, e.reason) for e in failed] == [("prepare-failed", reason)] * 2
        assert failed[0].event_id != failed[1].event_id and failed[0].error
    # recorded durably: a restart (NATS still away) still holds them
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        assert Counter(e.event for e in node.service.events.pending if e.claim_uid == claim.uid) == {
            "prepare-failed": 2
        }


async def test_a_prepare_failing_after_it_started_records_the_failure_of_that_preparation_and_a_retry_its_own(
    claims: MemoryClaims, root: Path, dev_root: Path
) -> None:
    claim = claims.add(claim_doc(name="nocdi", results=[("gpu", "gpu-0")]))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        cdi = Path(node.cfg.cdi_dir)
        shutil.rmtree(cdi, ignore_errors=True)
        cdi.write_text("not a directory")  # the CDI spec write fails after prepare-started, and so does its undo
        assert (await node.plugin.prepare([claim]))[claim.uid].error
        failed = [e for e in node.service.events.pending if e.claim_uid == claim.uid]
        assert [(e.event, e.reason) for e in failed] == [("prepare-started", ""), ("prepare-failed", "internal")]
        assert len({e.event_id.split("/")[2] for e in failed}) == 1  # both of one preparation
        assert node.service.checkpoint.claims[claim.uid].state == "PrepareStarted"  # left for the retry to undo
        cdi.unlink()
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        events = [e for e in node.service.events.pending if e.claim_uid == claim.uid]
    assert [e.event for e in events[2:]] == ["rolled-back", "prepare-started", "prepared"]
    assert events[2].event_id.split("/")[2] == failed[0].event_id.split("/")[2]  # the undo of the first
    assert int(events[3].event_id.split("/")[2]) > int(failed[0].event_id.split("/")[2])
    assert len({e.event_id for e in events}) == 5


async def test_sigkill_with_nats_down_then_restart_delivers_the_events_exactly_once(
    root: Path, nats_server: EmbeddedNats, dev_root: Path
) -> None:
    log_path = root / "preparer.log"
    reg_socket = root / "reg" / "gpu.nvidia.com-reg.sock"
    outbox = root / "plugins" / "gpu.nvidia.com" / "outbox.jsonl"
    bus = await Bus.connect(nats_server.url, name="outbox-test")
    await bus.provision()
    await bus.close()
    async with running_apiserver(root / "api") as api, api.client() as client:
        claims = ApiClaims(client)
        claim = await claims.add(claim_doc(name="offline", results=[("gpu", "gpu-0")]))
        await nats_server.stop()
        proc = await start_preparer(root, api.kubeconfig_path, nats_server.url, log_path, "--dev-root", str(dev_root))
        try:
            await wait_for_socket(reg_socket, proc, log_path)
            plugin = await register(reg_socket)
            try:
                assert (await plugin.prepare([claim]))[claim.uid].error == ""
            finally:
                await plugin.close()
            lines = [json.loads(line) for line in outbox.read_bytes().splitlines()]
            assert [line["event"]["event"] for line in lines] == ["prepare-started", "prepared"]
        finally:
            proc.send_signal(signal.SIGKILL)
            assert await proc.wait() == -signal.SIGKILL
        await nats_server.start()
        proc = await start_preparer(root, api.kubeconfig_path, nats_server.url, log_path, "--dev-root", str(dev_root))
        try:
            await wait_for_socket(reg_socket, proc, log_path)
            reader = await Bus.connect(nats_server.url, name="reader")
            try:
                events = await stream_events(reader, 2)
                plugin = await register(reg_socket)
                try:
                    assert await plugin.unprepare([claim]) == {claim.uid: ""}
                finally:
                    await plugin.close()
                events = await stream_events(reader, 3)
            finally:
                await reader.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(15):
                await proc.wait()
    assert [e.event for e in events] == ["prepare-started", "prepared", "unprepared"]
    assert len({e.event_id for e in events}) == 3
    assert {e.claim_uid for e in events} == {claim.uid}


async def test_a_full_outbox_refuses_new_events_counts_them_and_compacts_what_was_sent(
    bus: Bus, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outbox_module, "COMPACT_MIN_ACKS", 2)
    path = root / "outbox.jsonl"
    events = LifecycleEvents("n1", "gpu.test", path, max_events=2)
    before = REGISTRY.get_sample_value("gpu_dra_outbox_dropped_total", {"driver": "gpu.test"}) or 0.0
    await events.outbox.add(
        [events.make("prepared", uid=f"u{i}", namespace="default", name=f"c{i}", preparation=i) for i in range(3)]
    )
    assert [e.claim_uid for e in events.pending] == ["u0", "u1"] and events.dropped == 1
    assert REGISTRY.get_sample_value("gpu_dra_outbox_dropped_total", {"driver": "gpu.test"}) == before + 1
    assert REGISTRY.get_sample_value("gpu_dra_outbox_events", {"driver": "gpu.test"}) == 2
    await send_all(events, bus)
    assert path.read_bytes() == b""  # acks outnumbered what is pending: rewritten with nothing left
    assert REGISTRY.get_sample_value("gpu_dra_outbox_events", {"driver": "gpu.test"}) == 0


def test_the_exported_schema_names_the_failure_reasons(tmp_path: Path) -> None:
    write_schemas(tmp_path)
    schema = json.loads((tmp_path / "ClaimLifecycle.json").read_text())
    assert set(schema["properties"]["reason"]["enum"]) == {
        "",
        "not-found",
        "not-allocated",
        "other-node",
        "invalid-config",
        "device-busy",
        "device-error",
        "timeout",
        "internal",
    }
    assert schema["properties"]["reason"]["default"] == ""  # older events without it stay valid
    event = (
        LifecycleEvents("n1", "gpu.nvidia.com")
        .make("prepare-failed", uid="u", namespace="d", name="c", preparation=7, error="no", reason="timeout")
        .event
    )
    jsonschema.validate(msgspec.to_builtins(event), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**msgspec.to_builtins(event), "reason": "bad luck"}, schema)


async def test_a_line_cut_short_by_a_crash_is_skipped_and_the_rest_is_sent(root: Path) -> None:
    path = root / "outbox.jsonl"
    first = LifecycleEvents("n1", "gpu.nvidia.com", path)
    records = [
        first.make(kind, uid="u1", namespace="default", name="c", preparation=4)
        for kind in ("prepare-started", "prepared")
    ]
    await first.outbox.add(records)
    with path.open("ab") as f:
        f.write(b'{"seq":3,"msg_id":"n1/u1/4/unprep')  # the write a SIGKILL interrupted
    again = LifecycleEvents("n1", "gpu.nvidia.com", path)
    assert await again.outbox.load() == 2
    assert [r.msg_id for r in again.outbox.pending.values()] == [r.msg_id for r in records]  # ids kept
    assert again.outbox.max_preparation == 4
    await again.outbox.add([again.make("unprepared", uid="u1", namespace="default", name="c", preparation=4)])
    assert await LifecycleEvents("n1", "gpu.nvidia.com", path).outbox.load() == 3  # nothing glued to the torn line


async def test_events_that_waited_out_a_round_in_flight_go_out_when_it_ends_without_a_second_linger(
    bus: Bus, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender lingers once from the wake an event causes: the first event waits `linger` for the rest of its
    burst; an event that came while a round was in flight, and has waited `linger` by the time that round is
    stored, goes out at once (a sender under load is not held back a linger per round)."""
    linger = 0.5
    events = LifecycleEvents("n1", "gpu.test", root / "outbox.jsonl", linger=linger)
    loop = asyncio.get_running_loop()
    started: list[float] = []
    ended: list[float] = []
    first_in_flight = asyncio.Event()
    release_first = asyncio.Event()
    send_round = events._send_round

    async def held(batch: list[tuple[int, outbox_module.OutboxRecord]]) -> list[int]:
        started.append(loop.time())
        if len(started) == 1:  # the first round stays in flight until the test lets it end
            first_in_flight.set()
            await release_first.wait()
        stored = await send_round(batch)
        ended.append(loop.time())
        return stored

    monkeypatch.setattr(events, "_send_round", held)
    events.attach(bus)
    sender = asyncio.create_task(events.run())
    try:
        added = loop.time()
        await events.outbox.add([events.make("prepared", uid="u1", namespace="default", name="c1", preparation=1)])
        await first_in_flight.wait()
        assert started[0] - added >= linger * 0.9  # the first event lingered for its burst
        await events.outbox.add([events.make("prepared", uid="u2", namespace="default", name="c2", preparation=2)])
        # time passing is what is tested (no event marks a linger's end): the second event waits out its linger
        # while the first round is away
        await asyncio.sleep(linger * 1.2)
        release_first.set()
        await events.drained()
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    assert len(started) == 2
    assert started[1] - ended[0] < linger / 2  # went out when the round ended, not a linger after it
    assert await stored_count(bus) == 2
