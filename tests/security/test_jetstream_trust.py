"""Attacks through JetStream's own operations, played as a hostile node holding `gpu-a`'s credentials
against a real nats-server on the shipped configuration with the state gate in front of JetStream: a push
consumer (or a direct get) whose answer would land on `gpu-b`'s device-request or health subject or KV key,
a `Nats-Rollup` on an own key, an oversized value, a flood of its own events. Each attack fails and
`gpu-b`'s state is unchanged; each probe is shown able to succeed where it is allowed (an honest request,
the admin making the same call, a bucket made the old way, a flood with no gate)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from prometheus_client import REGISTRY

from services.stategate.quota import Share
from shared import natsorigin
from shared.bus import Bus
from shared.events import catalog
from shared.events.claims import ClaimLifecycle
from shared.events.devices import SetSharingReply, SetSharingRequest
from shared.events.health import DeviceHealth
from shared.events.inventory import NodeInventory
from shared.natsserver import EmbeddedNats
from tests.deploy.conftest import ShippedConfigNats, nats_layout, server_env, start_gate, test_password
from tests.security.conftest import NODES, Conn, DeadLetters, bus_as, connect_watched

WAIT = 5.0
HEALTH_STREAM = f"KV_{catalog.HEALTH_BUCKET.name}"
OWN_KEY = f"$KV.{catalog.HEALTH_BUCKET.name}.gpu-a.gpu-0"
GATE = "dra.v1.gate.gpu-a.discovery"  # discovery.gpu-a's JetStream prefix: the state gate


async def _raw(server: EmbeddedNats, user: str) -> Conn:
    return await connect_watched(
        server.url, user=user, password=test_password(user), inbox_prefix=f"_INBOX_{user.replace('.', '_')}"
    )


async def _seed(server: EmbeddedNats) -> None:
    for node in NODES:
        async with bus_as(server, f"discovery.{node}") as bus:
            inventory = NodeInventory(node=node, driver_version="550.1", cuda_driver_version="12.4.0")
            await (await bus.kv(catalog.INVENTORY_BUCKET)).put(node, inventory)
            health = DeviceHealth(node=node, device="gpu-0", uuid=f"GPU-{node}", state="Healthy")
            await (await bus.kv(catalog.HEALTH_BUCKET)).put(f"{node}.gpu-0", health)


@pytest.fixture
async def seeded(shipped_nats: EmbeddedNats) -> AsyncIterator[EmbeddedNats]:
    """Each node's discovery has stored its inventory and a healthy GPU (through the gate)."""
    await _seed(shipped_nats)
    yield shipped_nats


async def _stored(admin: Bus, bucket: catalog.Bucket, key: str) -> bytes:
    return bytes((await admin.js.get_msg(f"KV_{bucket.name}", subject=f"$KV.{bucket.name}.{key}")).data or b"")


async def _through_gate(
    conn: Conn, call: str, body: bytes = b"", reply: str | None = None, headers: dict[str, str] | None = None
) -> dict[str, object]:
    """A call through the state gate as discovery.gpu-a; its answer decoded (a status as {"status": ...})."""
    if reply is not None:
        await conn.nc.publish(f"{GATE}.{call}", body, reply=reply, headers=headers)
        await conn.nc.flush()
        return {}
    answer = await conn.nc.request(f"{GATE}.{call}", body, timeout=WAIT, headers=headers)
    if not answer.data:
        return {
            "status": (answer.headers or {}).get("Status"),
            "description": (answer.headers or {}).get("Description"),
        }
    return dict(json.loads(answer.data))


def _sharing_request() -> bytes:
    """What the attacker wants gpu-b's discovery to do: compute mode Prohibited on its GPU."""
    return json.dumps({"gpu_uuids": ["GPU-gpu-b"], "compute_mode": "Prohibited", "timeslice": "Long"}).encode()


def _counted(metric_name: str, **labels: str) -> float:
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == metric_name
        for sample in metric.samples
        if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def test_a_consumer_delivering_on_another_nodes_request_subject_is_refused_and_never_acted_on(
    seeded: EmbeddedNats, admin_bus: Bus, dead_letters: DeadLetters
) -> None:
    """gpu-a keeps a sharing request as the value of its own health key and asks for a push consumer on it
    that delivers on gpu-b's `set-sharing` subject: the server refuses the call (no node makes a JetStream
    call), the gate refuses it (a node's consumer delivers to its own inbox only). The admin may create it:
    the server delivers, and gpu-b's discovery refuses what it was handed as `relayed`. gpu-b's own
    preparer is answered."""
    asked: list[SetSharingRequest] = []

    async def set_sharing(request: SetSharingRequest) -> SetSharingReply:
        asked.append(request)
        return SetSharingReply(ok=True)

    target = catalog.DEVICE_SET_SHARING.format(node="gpu-b")
    async with bus_as(seeded, "discovery.gpu-b") as victim, bus_as(seeded, "preparer.gpu-b") as preparer:
        await victim.serve(catalog.DEVICE_SET_SHARING, set_sharing, node="gpu-b")
        await victim.nc.flush()
        attacker = await _raw(seeded, "discovery.gpu-a")
        try:
            stored = await _through_gate(attacker, f"PUB.{OWN_KEY}", _sharing_request())  # its own key: allowed
            assert "seq" in stored, stored
            body = json.dumps(
                {
                    "stream_name": HEALTH_STREAM,
                    "config": {
                        "name": "evil",
                        "filter_subject": OWN_KEY,
                        "deliver_subject": target,
                        "ack_policy": "none",
                    },
                }
            ).encode()
            create = f"CONSUMER.CREATE.{HEALTH_STREAM}.evil.{OWN_KEY}"
            await attacker.request_refused(f"$JS.API.{create}", body)
            refused = await _through_gate(attacker, create, body)
            assert "its own inbox" in str(refused["error"]), refused
            # the same call by the admin: the server delivers it, gpu-b's discovery refuses it
            answer = json.loads((await admin_bus.nc.request(f"$JS.API.{create}", body, timeout=WAIT)).data)
            assert "error" not in answer, answer
            letter = await dead_letters.next(reason=natsorigin.RELAYED, subject=OWN_KEY)
            assert letter.consumer == victim.name and "consumer's delivery" in letter.error
            assert asked == [], f"gpu-b's discovery acted on a relayed request: {asked}"
            reply = await preparer.request(
                catalog.DEVICE_SET_SHARING,
                SetSharingRequest(gpu_uuids=["GPU-gpu-b"], compute_mode="Default"),
                node="gpu-b",
                timeout=WAIT,
            )
            assert reply.ok and [r.compute_mode for r in asked] == ["Default"]
        finally:
            await attacker.nc.close()


async def test_an_answer_aimed_at_another_nodes_health_subject_or_key_is_never_sent(
    seeded: EmbeddedNats, admin_bus: Bus, dead_letters: DeadLetters
) -> None:
    """gpu-a stores an XID-79 report naming gpu-b under its own key and asks for it (a direct get), and for a
    publish ack, with reply subjects naming gpu-b's health subject and gpu-b's inventory key: the gate
    answers only the asker's inbox, so nothing is published there and gpu-b's key keeps its value. The
    admin's direct get with that reply is delivered, and the publisher's consumer refuses it as relayed."""
    seen: list[DeviceHealth] = []

    async def on_health(health: DeviceHealth, _ctx: object) -> None:
        seen.append(health)

    forged = json.dumps({"node": "gpu-b", "device": "gpu-0", "uuid": "GPU-gpu-b", "state": "Unhealthy", "xid": 79})
    health_subject = catalog.HEALTH.format(node="gpu-b", device="gpu-0")
    inventory_key = f"$KV.{catalog.INVENTORY_BUCKET.name}.gpu-b"
    before = await _stored(admin_bus, catalog.INVENTORY_BUCKET, "gpu-b")
    refused_replies = _counted("gpu_dra_gate_refused", role="discovery", reason="reply")
    async with bus_as(seeded, "publisher") as publisher:
        await publisher.subscribe(catalog.HEALTH, on_health)
        await publisher.nc.flush()
        attacker = await _raw(seeded, "discovery.gpu-a")
        try:
            assert "seq" in await _through_gate(attacker, f"PUB.{OWN_KEY}", forged.encode())
            await attacker.nc.publish(f"$JS.API.DIRECT.GET.{HEALTH_STREAM}.{OWN_KEY}", b"", reply=health_subject)
            await attacker.nc.flush()
            await attacker.refused("publish", f"$JS.API.DIRECT.GET.{HEALTH_STREAM}.{OWN_KEY}")
            for reply in (health_subject, inventory_key):
                await _through_gate(attacker, f"DIRECT.GET.{HEALTH_STREAM}.{OWN_KEY}", reply=reply)
                await _through_gate(attacker, f"PUB.{OWN_KEY}", forged.encode(), reply=reply)
            async with asyncio.timeout(WAIT):
                while _counted("gpu_dra_gate_refused", role="discovery", reason="reply") < refused_replies + 4:
                    await asyncio.sleep(0.01)
            # the probe: the admin may name that reply, and the publisher refuses what arrives
            await admin_bus.nc.publish(f"$JS.API.DIRECT.GET.{HEALTH_STREAM}.{OWN_KEY}", b"", reply=health_subject)
            letter = await dead_letters.next(reason=natsorigin.RELAYED, subject=health_subject)
            assert letter.consumer == publisher.name
            assert seen == []
            assert await _stored(admin_bus, catalog.INVENTORY_BUCKET, "gpu-b") == before
        finally:
            await attacker.nc.close()


@pytest.mark.parametrize("headers", [{"Nats-Rollup": "all"}, {"KV-Operation": "PURGE", "Nats-Rollup": "sub"}])
async def test_a_rollup_on_an_own_key_is_refused_and_erases_nothing(
    seeded: EmbeddedNats, admin_bus: Bus, headers: dict[str, str]
) -> None:
    """A write on gpu-a's own key with a rollup header is refused by the server (no direct write), by the
    gate, and by the bucket itself (made without rollups). On a bucket made the old way the admin's same
    write erases gpu-b's key (the probe works)."""
    before = {key: await _stored(admin_bus, catalog.HEALTH_BUCKET, key) for key in ("gpu-a.gpu-0", "gpu-b.gpu-0")}
    attacker = await _raw(seeded, "discovery.gpu-a")
    try:
        await attacker.nc.publish(OWN_KEY, b"", headers=headers)
        await attacker.nc.flush()
        await attacker.refused("publish", OWN_KEY)
        answer = await _through_gate(attacker, f"PUB.{OWN_KEY}", headers=headers)
        assert "rollup" in str(answer["error"]).lower(), answer
        with pytest.raises(nats.js.errors.APIError, match=r"(?i)rollup"):
            await admin_bus.nc.jetstream().publish(OWN_KEY, b"", headers=headers)  # the bucket refuses it too
        after = {key: await _stored(admin_bus, catalog.HEALTH_BUCKET, key) for key in before}
        assert after == before
        info = await admin_bus.js.stream_info(HEALTH_STREAM)
        info.config.allow_rollup_hdrs = True  # as buckets used to be made
        await admin_bus.js.update_stream(info.config)
        await admin_bus.nc.jetstream().publish(OWN_KEY, b"", headers={"Nats-Rollup": "all"})
        with pytest.raises(nats.js.errors.NotFoundError):
            await _stored(admin_bus, catalog.HEALTH_BUCKET, "gpu-b.gpu-0")
    finally:
        await attacker.nc.close()


async def test_provisioning_turns_rollups_off_on_a_bucket_made_the_old_way(
    seeded: EmbeddedNats, admin_bus: Bus
) -> None:
    info = await admin_bus.js.stream_info(HEALTH_STREAM)
    info.config.allow_rollup_hdrs, info.config.max_msg_size = True, -1
    await admin_bus.js.update_stream(info.config)
    await admin_bus.provision()
    config = (await admin_bus.js.stream_info(HEALTH_STREAM)).config
    assert config.allow_rollup_hdrs is False and config.max_msg_size == catalog.HEALTH_BUCKET.max_value_size


async def test_an_oversized_value_or_event_is_refused_and_counted(seeded: EmbeddedNats, admin_bus: Bus) -> None:
    """A node's share of a bucket is bounded per message: a 512 KiB health value (157 MB were stored
    before) is refused by the server and counted; gpu-b's value is untouched."""
    before = await _stored(admin_bus, catalog.HEALTH_BUCKET, "gpu-b.gpu-0")
    counted = _counted("gpu_dra_jetstream_refused", reason="message-size")
    huge = DeviceHealth(node="gpu-a", device="gpu-0", uuid="GPU-gpu-a", state="Healthy", message="x" * (512 * 1024))
    async with bus_as(seeded, "discovery.gpu-a") as discovery:
        with pytest.raises(nats.js.errors.APIError):
            await (await discovery.kv(catalog.HEALTH_BUCKET)).put("gpu-a.gpu-0", huge)
        assert _counted("gpu_dra_jetstream_refused", reason="message-size") == counted + 1
        assert await _stored(admin_bus, catalog.HEALTH_BUCKET, "gpu-b.gpu-0") == before
        small = DeviceHealth(node="gpu-a", device="gpu-0", uuid="GPU-gpu-a", state="Healthy", message="x" * 1024)
        await (await discovery.kv(catalog.HEALTH_BUCKET)).put("gpu-a.gpu-0", small)  # within the limit: stored


async def test_a_dead_letter_flood_never_evicts_the_first_letters(seeded: EmbeddedNats, admin_bus: Bus) -> None:
    """gpu-a floods its own dead-letter subject after the letter about its forgery was filed there: the
    first letters stay, the flood past the per-subject share is refused."""
    subject = "dra.v1.deadletter.preparer_gpu-a.preparer_gpu-a"
    async with bus_as(seeded, "preparer.gpu-a") as attacker:
        first = await attacker.js.publish(subject, b'{"forensic": true}')
        refused = 0
        for n in range(catalog.DEAD_LETTER_STREAM.max_msgs_per_subject + 20):
            try:
                await attacker.js.publish(subject, json.dumps({"n": n}).encode())
            except nats.js.errors.APIError as exc:
                assert "maximum messages per subject" in str(exc).lower(), exc
                refused += 1
        assert refused == 21
        kept = await admin_bus.js.get_msg(catalog.DEAD_LETTER_STREAM.name, seq=first.seq)
        assert kept.data == b'{"forensic": true}'


async def test_a_responder_may_answer_only_its_nodes_preparer(seeded: EmbeddedNats) -> None:
    """gpu-a's preparer asks its own discovery with a reply subject that names gpu-b's health: nats-server
    would let a responder with `allow_responses` publish there; ours may answer only inboxes, so the
    server refuses it (and the bus would not answer a request whose reply is not an asker's inbox)."""
    responder = await _raw(seeded, "discovery.gpu-a")
    asker = await _raw(seeded, "preparer.gpu-a")
    watcher = await _raw(seeded, "admin")
    try:
        target = catalog.HEALTH.format(node="gpu-b", device="gpu-0")
        seen = await watcher.nc.subscribe(target)
        requests = await responder.nc.subscribe(catalog.DEVICE_MIG_CREATE.format(node="gpu-a"))
        await responder.nc.flush()
        await watcher.nc.flush()
        await asker.nc.publish(catalog.DEVICE_MIG_CREATE.format(node="gpu-a"), b"{}", reply=target)
        await asker.nc.flush()
        request = await requests.next_msg(timeout=WAIT)
        await responder.nc.publish(request.reply, b'{"node":"gpu-b","device":"gpu-0","state":"Unhealthy"}')
        await responder.nc.flush()
        await responder.refused("publish", target)
        with pytest.raises(nats.errors.TimeoutError):
            await seen.next_msg(timeout=0.5)
        inbox = "_INBOX_preparer_gpu-a.probe"  # the probe: its answer to its preparer's inbox goes through
        answers = await asker.nc.subscribe(inbox)
        await asker.nc.flush()
        await asker.nc.publish(catalog.DEVICE_MIG_CREATE.format(node="gpu-a"), b"{}", reply=inbox)
        request = await requests.next_msg(timeout=WAIT)
        await responder.nc.publish(request.reply, b"ok")
        assert (await answers.next_msg(timeout=WAIT)).data == b"ok"
    finally:
        for conn in (responder, asker, watcher):
            await conn.nc.close()


async def test_a_node_may_not_create_or_change_a_stream(seeded: EmbeddedNats) -> None:
    attacker = await _raw(seeded, "discovery.gpu-a")
    try:
        for verb in ("CREATE", "UPDATE"):
            body = json.dumps({"name": HEALTH_STREAM, "allow_rollup_hdrs": True}).encode()
            await attacker.request_refused(f"$JS.API.STREAM.{verb}.{HEALTH_STREAM}", body)
            assert "may not" in str((await _through_gate(attacker, f"STREAM.{verb}.{HEALTH_STREAM}", body))["error"])
    finally:
        await attacker.nc.close()


# ---- a node flooding its own claim subject ----------------------------------------------------------------

SHARE_BYTES_S = 20 * 1024
SHARE_BURST = 64 * 1024
EVENTS_BYTES = 2 * 1024 * 1024  # DRA_EVENTS made small, so that a flood past it shows what eviction is


@pytest.fixture
async def small_events(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedNats, Bus]]:
    """The shipped server with a gate whose node share is SHARE_BYTES_S, and DRA_EVENTS capped at EVENTS_BYTES."""
    config_dir = nats_layout(tmp_path / "nats", NODES)
    store = tmp_path / "nats" / "js"
    server = ShippedConfigNats(config_dir / "nats.conf", server_env("flood-test", store), store, gate=False)
    await server.start()
    gate = await start_gate(server.url, Share(rate=SHARE_BYTES_S, burst=SHARE_BURST))
    try:
        async with bus_as(server, "admin") as admin:
            await admin.provision()
            info = await admin.js.stream_info(catalog.EVENTS_STREAM.name)
            info.config.max_bytes = EVENTS_BYTES
            await admin.js.update_stream(info.config)
            yield server, admin
    finally:
        await gate.close()
        await server.close()


def _event(node: str, n: int, pad: int = 0) -> ClaimLifecycle:
    return ClaimLifecycle(
        event_id=f"{node}/{n}",
        claim_uid=f"uid-{n}",
        claim_namespace="team-b" if node == "gpu-b" else "team-a",
        claim_name="c" + "x" * pad,
        node=node,
        driver="gpu.nvidia.com",
        event="prepared",
        observed_at=float(n),
    )


async def _publish(bus: Bus, event: ClaimLifecycle) -> None:
    await bus.publish(
        catalog.CLAIM, event, msg_id=event.event_id, namespace=event.claim_namespace, node=event.node, event="prepared"
    )


async def _flood(bus: Bus, node: str, seconds: float, rate_bytes_s: float, size: int) -> tuple[int, int]:
    """Publish `rate_bytes_s` of `size`-byte events for `seconds`: (stored, refused)."""
    loop = asyncio.get_running_loop()
    start, stored, refused, n = loop.time(), 0, 0, 0
    while loop.time() - start < seconds:
        n += 1
        try:
            await _publish(bus, _event(node, 10_000 + n, pad=size))
            stored += 1
        except nats.js.errors.APIError as exc:
            assert "quota" in str(exc), exc
            refused += 1
        await asyncio.sleep(max(0.0, start + n * size / rate_bytes_s - loop.time()))
    return stored, refused


async def test_a_node_flooding_its_own_claim_subject_evicts_no_other_nodes_event(
    small_events: tuple[EmbeddedNats, Bus],
) -> None:
    """gpu-a publishes claim events at 100x its share for 3 s (the bench runs 60 s): the excess is refused by
    the gate and counted on both sides, and every event gpu-b stored before and during the flood is still
    in DRA_EVENTS. The same volume from the admin, who passes no gate, evicts gpu-b's first events."""
    server, admin = small_events
    gate_refusals = _counted("gpu_dra_gate_refused", role="preparer", reason="quota")
    node_refusals = _counted("gpu_dra_jetstream_refused", reason="quota")
    async with bus_as(server, "preparer.gpu-a") as attacker, bus_as(server, "preparer.gpu-b") as honest:
        for n in range(5):
            await _publish(honest, _event("gpu-b", n))
        flood = asyncio.create_task(_flood(attacker, "gpu-a", 3.0, 100 * SHARE_BYTES_S, 16 * 1024))
        for n in range(5, 10):
            await _publish(honest, _event("gpu-b", n))
            await asyncio.sleep(0.2)
        stored, refused = await flood
    assert refused > 10 * stored > 0, (stored, refused)
    assert _counted("gpu_dra_gate_refused", role="preparer", reason="quota") == gate_refusals + refused
    assert _counted("gpu_dra_jetstream_refused", reason="quota") == node_refusals + refused
    kept = await _node_events(admin, "gpu-b")
    assert kept == [f"gpu-b/{n}" for n in range(10)]
    # the probe: the same flood with no share to hold it (the admin publishes directly) evicts gpu-b's events
    for _ in range(EVENTS_BYTES // (16 * 1024) + 16):
        await admin.js.publish(
            catalog.CLAIM.format(namespace="team-a", node="gpu-a", event="prepared"), b"x" * (16 * 1024)
        )
    assert (await _node_events(admin, "gpu-b"))[:1] != ["gpu-b/0"]


async def _node_events(admin: Bus, node: str) -> list[str]:
    """The event ids of `node`'s claim events still stored in DRA_EVENTS, in order."""
    subject = catalog.CLAIM.wildcard(node=node)
    info = await admin.js.stream_info(catalog.EVENTS_STREAM.name, subjects_filter=subject)
    count = sum((info.state.subjects or {}).values())
    sub = await admin.js.subscribe(subject, stream=catalog.EVENTS_STREAM.name, ordered_consumer=True)
    try:
        ids = []
        for _ in range(count):
            ids.append(json.loads((await sub.next_msg(timeout=WAIT)).data)["event_id"])
        return ids
    finally:
        await sub.unsubscribe()
