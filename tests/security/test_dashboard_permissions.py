"""The dashboard's JetStream rights, against a real nats-server on the shipped config with the generated users:
`reader.dashboard` may create consumers on DRA_EVENTS filtered inside `dra.v1.claim.>` (its GPU-hours replay)
and answer their flow control, nothing else of JetStream; a reader may not do what the dashboard may. Each attack
is awaited as the server's permissions violation, its victim is shown unchanged, and the allowed path working."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from shared.bus import Bus, MsgContext
from shared.events import catalog
from shared.events.claims import ClaimLifecycle
from shared.natsserver import EmbeddedNats
from tests.deploy.conftest import test_password
from tests.security.conftest import Conn, bus_as, connect_watched, provisioned_nats

WAIT_S = 10.0
STREAM = catalog.EVENTS_STREAM.name
TEAM_A = catalog.CLAIM.wildcard(namespace="team-a")
DURABLE = "reader_billing"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """The shipped server with reader `billing` (team-a) beside the dashboard, streams provisioned."""
    async with provisioned_nats(tmp_path, ["gpu-a"], {"billing": ["team-a"]}) as srv:
        yield srv


async def _connect(srv: EmbeddedNats, user: str) -> Conn:
    inbox = "_INBOX_" + user.replace(".", "_")
    return await connect_watched(srv.url, user=user, password=test_password(user), inbox_prefix=inbox)


def _create(name: str, filter_subject: str, deliver: str, stream: str = STREAM) -> tuple[str, bytes]:
    """A consumer create as nats-py sends it: the filter in the subject and the body."""
    config = {"name": name, "filter_subject": filter_subject, "deliver_subject": deliver}
    body = json.dumps({"stream_name": stream, "config": config}).encode()
    return f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{filter_subject}", body


async def _claim(preparer: Bus, n: int, ns: str = "team-a") -> None:
    event = ClaimLifecycle(
        event_id=f"gpu-a/u{n}/prepared/1",
        claim_uid=f"u{n}",
        claim_namespace=ns,
        claim_name=f"c{n}",
        node="gpu-a",
        driver="gpu.nvidia.com",
        event="prepared",
        observed_at=time.time(),
    )
    await preparer.publish(catalog.CLAIM, event, msg_id=f"e{n}", namespace=ns, node="gpu-a", event="prepared")


async def test_the_dashboard_replays_claim_events_and_reaches_nothing_else_of_jetstream(server: EmbeddedNats) -> None:
    preparer = await Bus.connect(
        server.url, name="p", user="preparer.gpu-a", password=test_password("preparer.gpu-a"), initial_attempts=2
    )
    billing = await _connect(server, "reader.billing")
    dashboard = await _connect(server, "reader.dashboard")
    try:
        js = billing.nc.jetstream()
        await js.add_consumer(
            STREAM,
            ConsumerConfig(name=DURABLE, durable_name=DURABLE, filter_subject=TEAM_A, ack_policy=AckPolicy.EXPLICIT),
        )
        await _claim(preparer, 1)
        await _claim(preparer, 2, ns="team-b")
        inbox = "_INBOX_reader_dashboard.x"
        # another stream, a filter outside the claims, no filter, a durable create, another reader's durable
        for subject, body in (
            _create("d1", "dra.v1.deadletter.>", inbox, catalog.DEAD_LETTER_STREAM.name),
            _create("d2", f"$KV.{catalog.INVENTORY_BUCKET.name}.>", inbox, f"KV_{catalog.INVENTORY_BUCKET.name}"),
            _create("d3", "dra.v1.health.>", inbox),
            _create("d4", "dra.v1.>", inbox),
            _create(DURABLE, "dra.v1.claim.>", inbox),
            (f"$JS.API.CONSUMER.CREATE.{STREAM}", b""),
            (f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.d5", b""),
        ):
            await dashboard.request_refused(subject, body)
        for verb in ("INFO", "MSG.NEXT", "DELETE"):
            await dashboard.request_refused(f"$JS.API.CONSUMER.{verb}.{STREAM}.{DURABLE}", b'{"batch": 1}')
        await dashboard.request_refused(f"$JS.API.STREAM.INFO.{STREAM}")
        # billing's durable: still its own filter, its event still there for it
        info = await js.consumer_info(STREAM, DURABLE)
        assert info.config.filter_subject == TEAM_A and info.num_pending == 1
        (msg,) = await (await js.pull_subscribe_bind(DURABLE, stream=STREAM)).fetch(1, timeout=WAIT_S)
        assert json.loads(msg.data)["claim_uid"] == "u1"

        # the reader may not do what the dashboard may: every namespace's claims, or read the dashboard's deliveries
        subject, body = _create("r1", "dra.v1.claim.>", "_INBOX_reader_billing.x")
        await billing.request_refused(subject, body)
        await billing.nc.subscribe("_INBOX_reader_dashboard.>")
        await billing.nc.flush()
        await billing.refused("subscription", "_INBOX_reader_dashboard.>")

        # the dashboard's own replay: an ordered consumer of every claim event since a minute ago
        seen: asyncio.Queue[str] = asyncio.Queue()

        async def on_claim(event: ClaimLifecycle, ctx: MsgContext) -> None:
            seen.put_nowait(f"{event.claim_uid}{' (replayed)' if ctx.replayed else ''}")

        async with bus_as(server, "reader.dashboard") as bus:
            await bus.subscribe(catalog.CLAIM, on_claim, since=time.time() - 60)
            await _claim(preparer, 3)
            got = [await asyncio.wait_for(seen.get(), WAIT_S) for _ in range(3)]
            assert got == ["u1 (replayed)", "u2 (replayed)", "u3"]
        assert dashboard.errors.empty() and billing.errors.empty()
    finally:
        await dashboard.nc.close()
        await billing.nc.close()
        await preparer.close()
