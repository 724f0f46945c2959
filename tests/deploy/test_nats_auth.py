"""A real nats-server with the shipped config and generated users (test passwords): each node
service may publish its own node's subjects and is refused another node's, and cluster services
cannot forge node events. Refusals arrive as the server's async permissions-violation error,
which the tests await; allowed publishes are awaited at a subscriber."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client

from shared.bus import Bus, inbox_prefix
from shared.events import catalog
from shared.events.inventory import NodeInventory
from shared.natsserver import EmbeddedNats
from tests.deploy.conftest import ShippedConfigNats, nats_layout, server_env, test_password

NODES = ["gpu-a", "gpu-b"]
WAIT = 5.0


@dataclass
class Conn:
    nc: Client
    errors: asyncio.Queue[str]

    async def refused(self, verb: str, subject: str) -> None:
        """Wait for the server's permissions violation naming `subject`."""
        expected = f'permissions violation for {verb} to "{subject}"'
        seen = []
        try:
            while True:
                error = await asyncio.wait_for(self.errors.get(), WAIT)
                if expected.lower() in error.lower():
                    return
                seen.append(error)
        except TimeoutError:
            raise AssertionError(f"no refusal of {verb} to {subject!r} within {WAIT}s; errors seen: {seen}") from None


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    config_dir = nats_layout(tmp_path, NODES)
    store = tmp_path / "js"
    srv = ShippedConfigNats(config_dir / "nats.conf", server_env("auth-test", store), store)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.close()


async def _connect(srv: EmbeddedNats, user: str, password: str | None = None) -> Conn:
    errors: asyncio.Queue[str] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        errors.put_nowait(str(exc))

    nc = await nats.connect(
        srv.url,
        user=user,
        password=password or test_password(user),
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=2,
        inbox_prefix=inbox_prefix(user),
    )
    return Conn(nc, errors)


async def _delivered(admin: Conn, publisher: Conn, subject: str) -> None:
    """`publisher` publishes on `subject` and the admin's subscription receives it.

    Published again every second until it arrives (at most WAIT): an allowed subject must get
    through, and a refusal would show up as an error on either connection."""
    sub = await admin.nc.subscribe(subject)
    await admin.nc.flush()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    msg = None
    while msg is None and loop.time() < deadline:
        await publisher.nc.publish(subject, b"{}")
        await publisher.nc.flush()
        try:
            msg = await sub.next_msg(timeout=1.0)
        except nats.errors.TimeoutError:
            continue
    if msg is None:
        seen = [c.errors.get_nowait() for c in (publisher, admin) for _ in range(c.errors.qsize())]
        raise AssertionError(f"{subject!r} was not delivered within {WAIT}s; errors seen: {seen}")
    assert msg.subject == subject
    await sub.unsubscribe()


async def _stored_through_gate(admin: Conn, user: str, conn: Conn, subject: str) -> None:
    """`user` asks the state gate to store on `subject`; the gate publishes it (the admin sees it), and its
    answer comes back to the asker's inbox (the server's ack, or 503 where no stream is provisioned)."""
    role, node = user.split(".", 1)
    sub = await admin.nc.subscribe(subject)
    await admin.nc.flush()
    answer = await conn.nc.request(f"dra.v1.gate.{node}.{role}.PUB.{subject}", b"{}", timeout=WAIT)
    assert b"error" not in answer.data, answer.data
    assert (await sub.next_msg(timeout=WAIT)).subject == subject
    await sub.unsubscribe()


async def _refused_by_gate(user: str, conn: Conn, subject: str) -> None:
    role, node = user.split(".", 1)
    answer = await conn.nc.request(f"dra.v1.gate.{node}.{role}.PUB.{subject}", b"{}", timeout=WAIT)
    assert b"may not" in answer.data, answer.data


async def _refused(conn: Conn, subject: str) -> None:
    await conn.nc.publish(subject, b"{}")
    await conn.nc.flush()
    await conn.refused("publish", subject)


async def test_a_node_agent_publishes_its_own_nodes_subjects_and_is_refused_another_nodes(server: EmbeddedNats) -> None:
    """A node agent stores its own node's events and keys through the state gate only (no stream's subject
    is open to it on the server, not even its own), sends its own node's requests, and is refused
    another node's subjects by the gate and everything else by the server."""
    provisioner = await Bus.connect(server.url, name="admin", user="admin", password=test_password("admin"))
    await provisioner.provision()
    await provisioner.close()
    admin = await _connect(server, "admin")
    users = ("discovery.gpu-a", "preparer.gpu-a", "cd-agent.gpu-a")
    conns = {user: await _connect(server, user) for user in users}
    discovery, preparer, cd_agent = (conns[u] for u in users)
    try:
        stored = [
            ("discovery.gpu-a", catalog.INVENTORY.format(node="gpu-a")),
            ("discovery.gpu-a", catalog.HEALTH.format(node="gpu-a", device="gpu-0")),
            ("discovery.gpu-a", catalog.INVENTORY_WITHDRAWN.format(node="gpu-a")),
            ("discovery.gpu-a", "$KV.dra-inventory.gpu-a"),
            ("preparer.gpu-a", catalog.CLAIM.format(namespace="team-x", node="gpu-a", event="prepared")),
            ("cd-agent.gpu-a", catalog.CD_MEMBER.format(domain_uid="cd-1", node="gpu-a")),
            ("cd-agent.gpu-a", "$KV.dra-cd-members.cd-1.gpu-a"),
        ]
        for user, subject in stored:
            await _stored_through_gate(admin, user, conns[user], subject)
            await _refused(conns[user], subject)  # the same subject directly: refused by the server
        await _delivered(admin, preparer, catalog.DEVICE_MIG_CREATE.format(node="gpu-a"))
        for user, subject in [
            ("discovery.gpu-a", catalog.INVENTORY.format(node="gpu-b")),
            ("discovery.gpu-a", catalog.HEALTH.format(node="gpu-b", device="gpu-0")),
            ("discovery.gpu-a", catalog.INVENTORY_WITHDRAWN.format(node="gpu-b")),
            ("discovery.gpu-a", "$KV.dra-inventory.gpu-b"),
            ("discovery.gpu-a", "$KV.dra-health.gpu-b.gpu-0"),
            ("discovery.gpu-a", catalog.CLAIM.format(namespace="team-x", node="gpu-a", event="prepared")),
            ("preparer.gpu-a", catalog.CLAIM.format(namespace="team-x", node="gpu-b", event="prepared")),
            ("preparer.gpu-a", catalog.INVENTORY.format(node="gpu-a")),
            ("cd-agent.gpu-a", catalog.CD_MEMBER.format(domain_uid="cd-1", node="gpu-b")),
            ("cd-agent.gpu-a", "$KV.dra-cd-members.cd-1.gpu-b"),
            ("cd-agent.gpu-a", catalog.CD_STATUS.format(domain_uid="cd-1")),
        ]:
            await _refused_by_gate(user, conns[user], subject)
        for conn, subject in [
            (preparer, catalog.DEVICE_MIG_CREATE.format(node="gpu-b")),
            # no node agent may reshape or empty the streams, or make any JetStream call itself
            (discovery, "$JS.API.STREAM.UPDATE.DRA_EVENTS"),
            (discovery, "$JS.API.STREAM.PURGE.KV_dra-inventory"),
            (preparer, "$JS.API.STREAM.DELETE.DRA_EVENTS"),
            (cd_agent, "$JS.API.STREAM.MSG.DELETE.KV_dra-cd-members"),
            (cd_agent, "$JS.API.INFO"),
        ]:
            await _refused(conn, subject)
    finally:
        for conn in (admin, *conns.values()):
            await conn.nc.close()


async def test_a_node_agent_may_not_listen_to_another_nodes_device_requests(server: EmbeddedNats) -> None:
    discovery = await _connect(server, "discovery.gpu-a")
    try:
        await discovery.nc.subscribe(catalog.DEVICE_MIG_CREATE.format(node="gpu-a"))
        other = catalog.DEVICE_MIG_CREATE.format(node="gpu-b")
        await discovery.nc.subscribe(other)
        await discovery.nc.flush()
        await discovery.refused("subscription", other)
        assert discovery.errors.empty(), "its own node's subscription was refused"
    finally:
        await discovery.nc.close()


async def test_cluster_services_cannot_forge_node_events(server: EmbeddedNats) -> None:
    publisher = await _connect(server, "publisher")
    controller = await _connect(server, "controller")
    try:
        await _refused(publisher, catalog.INVENTORY.format(node="gpu-a"))
        await _refused(publisher, catalog.CLAIM.format(namespace="ns", node="gpu-a", event="prepared"))
        await _refused(controller, catalog.CD_MEMBER.format(domain_uid="cd-1", node="gpu-a"))
    finally:
        await publisher.nc.close()
        await controller.nc.close()


async def test_a_wrong_password_is_refused(server: EmbeddedNats) -> None:
    with pytest.raises((nats.errors.Error, OSError)):
        await _connect(server, "discovery.gpu-a", password="not-the-password")


async def test_discovery_starts_through_the_bus_with_its_node_user(server: EmbeddedNats) -> None:
    """The service start path (connect, provision, KV put, durable publish) works within the
    permissions, and the stored values are readable by the publisher's user."""
    admin = await Bus.connect(server.url, name="admin", user="admin", password=test_password("admin"))
    await admin.provision()
    bus = await Bus.connect(
        server.url, name="discovery-gpu-a", user="discovery.gpu-a", password=test_password("discovery.gpu-a")
    )
    reader = await Bus.connect(server.url, name="publisher", user="publisher", password=test_password("publisher"))
    try:
        await bus.provision()  # a node's services provision nothing: a no-op
        inventory = NodeInventory(node="gpu-a", driver_version="550.163.1", cuda_driver_version="12.4.0")
        kv = await bus.kv(catalog.INVENTORY_BUCKET)
        await kv.put("gpu-a", inventory)
        await bus.publish(catalog.INVENTORY, inventory, msg_id="gpu-a-1", node="gpu-a")
        assert await kv.get("gpu-a") == inventory
        stored = await (await reader.kv(catalog.INVENTORY_BUCKET)).get("gpu-a")
        assert stored == inventory
        info = await reader.js.stream_info(catalog.EVENTS_STREAM.name)
        assert info.state.messages == 1
    finally:
        await reader.close()
        await bus.close()
        await admin.close()
