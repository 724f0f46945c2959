"""The bus over a real nats-server: typed events across processes, traces, dead letters, reconnect."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from prometheus_client import REGISTRY

from shared.bus import CONSUMER_PENDING, Bus, MsgContext
from shared.events import catalog
from shared.events.deadletter import DeadLetter
from shared.events.devices import MigCreateReply, MigCreateRequest
from shared.events.inventory import Gpu, MigPlacement, NodeInventory
from shared.jetstream import WATCH_INACTIVE_S
from shared.natsserver import EmbeddedNats
from shared.telemetry import memory_spans, setup_telemetry
from tests.polling import eventually

setup_telemetry("tests", "memory")
tracer = trace.get_tracer(__name__)


def inventory(node: str) -> NodeInventory:
    gpu = Gpu(
        name="gpu-0",
        index=0,
        minor=0,
        uuid="GPU-1",
        product_name="NVIDIA H100 80GB HBM3",
        brand="Nvidia",
        architecture="Hopper",
        cuda_compute_capability="9.0.0",
        memory_bytes=85899345920,
        pci_bus_id="0000:3b:00.0",
    )
    return NodeInventory(node=node, driver_version="550.163.1", cuda_driver_version="12.4.0", gpus=[gpu])


async def read_line(stream: asyncio.StreamReader) -> str:
    return (await asyncio.wait_for(stream.readline(), timeout=20)).decode().strip()


async def test_event_crosses_processes_with_trace_and_dead_letter(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    producer = await Bus.connect(nats_server.url, name="test-producer")
    await producer.provision()
    trace_file = tmp_path / "spans.jsonl"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.shared.consumer_proc",
        nats_server.url,
        str(trace_file),
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert await read_line(proc.stdout) == "READY"
    letters: list[DeadLetter] = []
    got_letter = asyncio.Event()

    async def on_letter(msg: DeadLetter, ctx: MsgContext) -> None:
        letters.append(msg)
        got_letter.set()

    await producer.subscribe(catalog.DEAD_LETTER, on_letter)
    with tracer.start_as_current_span("test-root") as root:
        await producer.publish(catalog.INVENTORY, inventory("n1"), msg_id="n1-1", node="n1")
        root_trace = root.get_span_context().trace_id
    line = await read_line(proc.stdout)
    assert line == f"GOT node=n1 gpus=1 trace={root_trace:032x}"
    # A malformed payload on the same subject: dead-lettered, and the consumer keeps consuming.
    await producer.js.publish("dra.v1.inventory.bad", b'{"node": 5')
    await asyncio.wait_for(got_letter.wait(), timeout=10)
    assert letters[0].subject == "dra.v1.inventory.bad"
    assert letters[0].consumer == "test-consumer"
    await producer.publish(catalog.INVENTORY, inventory("last"), node="last")
    assert (await read_line(proc.stdout)).startswith("GOT node=last")
    assert await asyncio.wait_for(proc.wait(), timeout=20) == 0
    spans = [json.loads(x) for x in trace_file.read_text().splitlines()]
    consumer_span = next(s for s in spans if s["attributes"].get("messaging.destination.name") == "dra.v1.inventory.n1")
    assert consumer_span["trace_id"] == f"{root_trace:032x}"
    producer_span = next(
        s
        for s in memory_spans()
        if s.name == "publish inventory"
        and (s.attributes or {}).get("messaging.destination.name") == "dra.v1.inventory.n1"
        and s.context.trace_id == root_trace  # other tests in this process publish on the same subject
    )
    assert consumer_span["trace_id"] == f"{producer_span.context.trace_id:032x}"
    assert consumer_span["parent_span_id"] == f"{producer_span.context.span_id:016x}"
    # The payload decodes to the same Struct on the stream too.
    stored = await producer.js.get_last_msg("DRA_EVENTS", "dra.v1.inventory.n1")
    assert stored.data is not None
    assert msgspec.json.decode(stored.data, type=NodeInventory) == inventory("n1")
    await producer.close()


async def test_request_reply_and_kv(nats_server: EmbeddedNats) -> None:
    bus = await Bus.connect(nats_server.url, name="t")
    await bus.provision()
    await bus.provision()  # idempotent

    async def create(req: MigCreateRequest) -> MigCreateReply:
        return MigCreateReply(ok=req.profile == "1g.10gb", created=True)

    await bus.serve(catalog.DEVICE_MIG_CREATE, create, node="n1")
    reply = await bus.request(
        catalog.DEVICE_MIG_CREATE,
        MigCreateRequest(gpu_uuid="GPU-1", profile="1g.10gb", placement=MigPlacement(0, 1)),
        node="n1",
    )
    assert reply == MigCreateReply(ok=True, created=True)
    # An undecodable request gets a typed error reply.
    raw = await bus.nc.request("dra.v1.device.n1.mig-create", b"[]", timeout=5)
    bad = msgspec.json.decode(raw.data, type=MigCreateReply)
    assert not bad.ok and bad.error is not None and bad.error.code == "invalid-request"
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    assert await kv.get("n1") is None
    with tracer.start_as_current_span("writer") as writer:
        await kv.put("n1", inventory("n1"))
        await kv.put("n2", inventory("n2"))
    assert await kv.get("n1") == inventory("n1")
    assert await kv.keys() == ["n1", "n2"]
    # a reader acting on a value continues the writer's trace (the put's headers, kept from the read)
    with kv.consume("n1") as consumed:
        pass
    assert isinstance(consumed, ReadableSpan)
    assert consumed.parent is not None and consumed.parent.span_id == writer.get_span_context().span_id
    assert consumed.kind == trace.SpanKind.CONSUMER and consumed.name == "consume dra-inventory"
    # a delete carries the deleter's context too (a member leaving: the domain's status follows its trace)
    with tracer.start_as_current_span("deleter") as deleter:
        await kv.delete("n2")
    assert await kv.get("n2") is None
    with kv.consume("n2") as consumed:
        pass
    assert isinstance(consumed, ReadableSpan)
    assert consumed.parent is not None and consumed.parent.span_id == deleter.get_span_context().span_id
    await kv.put("n2", inventory("n2"))
    # each delivery of a watch says how many values its consumer has yet to deliver: none after the last
    CONSUMER_PENDING.labels("kv:dra-inventory").set(-1)  # not a count: proves the watch set it
    watch = kv.watch()
    assert [(await anext(watch))[0] for _ in range(3)] == ["n1", "n2", ""]
    assert REGISTRY.get_sample_value("gpu_dra_nats_consumer_pending", {"consumer": "kv:dra-inventory"}) == 0
    await watch.aclose()
    await bus.close()


async def test_clients_reconnect_after_server_restart(nats_server: EmbeddedNats) -> None:
    bus = await Bus.connect(nats_server.url, name="reconnecting")
    await bus.provision()
    received: asyncio.Queue[str] = asyncio.Queue()

    async def on_inventory(msg: NodeInventory, ctx: MsgContext) -> None:
        await received.put(msg.node)

    await bus.subscribe(catalog.INVENTORY, on_inventory)
    await bus.publish(catalog.INVENTORY, inventory("before"), node="before")
    assert await asyncio.wait_for(received.get(), 10) == "before"
    await nats_server.stop(kill=True)
    await nats_server.start()
    deadline = asyncio.get_running_loop().time() + 20
    while True:  # reconnect is asynchronous; keep publishing until it goes through
        try:
            await bus.publish(catalog.INVENTORY, inventory("after"), node="after")
            break
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)
    assert await asyncio.wait_for(received.get(), 10) == "after"
    await bus.close()


def test_subject_tokens_are_checked() -> None:
    with pytest.raises(ValueError, match="no dots"):
        catalog.INVENTORY.format(node="a.b")
    assert catalog.CLAIM.wildcard(namespace="ns") == "dra.v1.claim.ns.*.*"


@pytest.mark.parametrize("token", ["gpu-a\n", "gpu-a\r\nPUB x 1", "", "gpu a", "gpu-*", ">"])
def test_a_subject_token_that_would_break_the_protocol_line_is_refused(token: str) -> None:
    """A token is checked whole: a trailing newline (which a `$`-anchored match lets through) would end the
    PUB line early on the wire."""
    with pytest.raises(catalog.SubjectError):
        catalog.INVENTORY.format(node=token)
    assert "\n" not in catalog.as_token(token) and "." not in catalog.as_token(token)


@pytest.mark.parametrize(
    ("value", "token"),
    [("team-a", "team-a"), ("gpu_node-0", "gpu_node-0"), ("a.b", "a_b"), ("gpu-a\n", "gpu-a_"), ("", "_"), ("é", "_")],
)
def test_as_token_keeps_a_safe_value_and_replaces_the_rest(value: str, token: str) -> None:
    assert catalog.as_token(value) == token


async def test_provisioning_raises_the_event_streams_limit_of_a_stream_made_before(bus: Bus) -> None:
    """DRA_EVENTS made with the old 256 MiB limit gets the catalog's (2 GiB: a slow durable consumer's backlog at
    10,000 events/s, bench/events_bench.py) at the next provision; its events stay."""
    stream = catalog.EVENTS_STREAM.name
    info = await bus.js.stream_info(stream)
    info.config.max_bytes = 256 * 1024 * 1024
    await bus.js.update_stream(info.config)
    await bus.js.publish(catalog.CLAIM.format(namespace="ns", node="n1", event="prepared"), b"{}")
    await bus.provision()
    info = await bus.js.stream_info(stream)
    assert info.config.max_bytes == catalog.EVENTS_STREAM.max_bytes == 2 * 1024 * 1024 * 1024
    assert info.state.messages == 1


def _streams() -> list[tuple[str, int]]:
    return [(s.name, s.max_consumers) for s in catalog.STREAMS] + [
        (f"KV_{b.name}", b.max_consumers) for b in catalog.BUCKETS
    ]


async def test_provisioning_sizes_every_stream_and_bucket_for_the_fleets_watches(bus: Bus) -> None:
    """nats-server 2.15 refuses a stream's 1,001st consumer unless the stream sets its own limit (-1, nats-py's
    for a bucket, counts as none): with a watch per node on a bucket, a fleet stopped at 1,000 nodes. Every
    stream and bucket gets the catalog's limit, and a bucket made before (-1) gets it at the next provision."""
    stream = f"KV_{catalog.INVENTORY_BUCKET.name}"
    info = await bus.js.stream_info(stream)
    info.config.max_consumers = -1
    await bus.js.update_stream(info.config)
    await bus.provision()
    for name, limit in _streams():
        assert (await bus.js.stream_info(name)).config.max_consumers == limit == catalog.FLEET_CONSUMERS, name
    assert catalog.FLEET_CONSUMERS >= catalog.FLEET_NODES * 2 > 1000  # a node's discovery and preparer watch each


async def test_an_account_limit_below_the_catalogs_is_kept(tmp_path: Path) -> None:
    """An operator's account limit on consumers per stream stays the limit: the server would refuse a stream
    asking for more."""
    config = tmp_path / "limited.conf"
    config.write_text("accounts { A: { jetstream: { max_consumers: 500 }, users: [ { user: a, password: a } ] } }\n")
    async with EmbeddedNats(store_dir=tmp_path / "nats", config_file=config) as srv:
        bus = await Bus.connect(srv.url.replace("nats://", "nats://a:a@"), name="limited")
        try:
            await bus.provision()
            for name, _limit in _streams():
                assert (await bus.js.stream_info(name)).config.max_consumers == 500, name
        finally:
            await bus.close()


async def test_callers_opening_a_bucket_at_once_share_one_typed_kv_and_its_trace_contexts(bus: Bus) -> None:
    """Two tasks of a service (the ComputeDomain controller's member watch and its assigner) open the same
    bucket at once: both get the one TypedKV, so a value the first one's watch read is consumed by the
    second one's handle as the child of its writer (two objects lost the writer's context: a root span)."""
    watcher_kv, other_kv = await asyncio.gather(bus.kv(catalog.INVENTORY_BUCKET), bus.kv(catalog.INVENTORY_BUCKET))
    assert watcher_kv is other_kv
    watch = watcher_kv.watch("n1")
    assert (await anext(watch))[0] == ""
    with tracer.start_as_current_span("writer") as writer:
        await (await bus.kv(catalog.INVENTORY_BUCKET)).put("n1", inventory("n1"))
    assert (await anext(watch))[0] == "n1"
    await watch.aclose()
    with other_kv.consume("n1") as consumed:
        pass
    assert isinstance(consumed, ReadableSpan)
    assert consumed.parent is not None and consumed.parent.span_id == writer.get_span_context().span_id


async def test_each_watched_write_is_consumed_in_its_own_writers_trace(bus: Bus) -> None:
    """Two writes of one key reach the watch before its reader acts on the first: each is consumed as the
    child of its own writer (keyed by key alone, the first one was consumed in the second one's trace)."""
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    watch = kv.watch("n1")
    assert (await anext(watch))[0] == ""
    writers = []
    for seq in range(2):
        CONSUMER_PENDING.labels("kv:dra-inventory").set(-1)  # each delivery sets it (to 0: nothing after it)
        with tracer.start_as_current_span(f"writer-{seq}") as writer:
            await kv.put("n1", msgspec.structs.replace(inventory("n1"), content_hash=str(seq)))
        writers.append(writer.get_span_context().span_id)
        await eventually(
            lambda: REGISTRY.get_sample_value("gpu_dra_nats_consumer_pending", {"consumer": "kv:dra-inventory"}) == 0,
            f"write {seq} delivered to the watch",
        )
    consumed_parents = []
    for seq in range(2):
        key, value = await anext(watch)
        assert key == "n1" and value is not None and value.content_hash == str(seq)
        with kv.consume("n1") as consumed:
            pass
        assert isinstance(consumed, ReadableSpan) and consumed.parent is not None
        consumed_parents.append(consumed.parent.span_id)
    await watch.aclose()
    assert consumed_parents == writers


async def test_a_kv_watch_asks_the_server_to_end_its_consumer_soon_after_it(bus: Bus) -> None:
    """A watch stopped, a key listing done or an ordered consumer reset leaves its consumer behind until its
    inactive threshold: nats-py's 5 minutes counted every one of them against the stream's limit."""
    kv = await bus.kv(catalog.INVENTORY_BUCKET)
    await kv.put("n1", inventory("n1"))
    watch = kv.watch("n1")
    assert (await anext(watch))[0] == "n1"
    infos = await bus.js.consumers_info(f"KV_{catalog.INVENTORY_BUCKET.name}")
    assert [c.config.inactive_threshold for c in infos] == [WATCH_INACTIVE_S]
    await watch.aclose()
