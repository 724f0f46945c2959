"""The attack suite's parts: a real nats-server on the shipped configuration with the generated users
(test passwords) for two GPU nodes, buses connected as each user, and the embedded API server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client

import embedded.apiserver.testing as apiserver_testing
from shared.bus import Bus
from shared.events import catalog
from shared.events.deadletter import DeadLetter
from shared.kube.client import kube_api_client
from shared.natsserver import EmbeddedNats
from tests.deploy.conftest import ShippedConfigNats, nats_layout, server_env, test_password
from tests.preparer.conftest import discovery, root  # noqa: F401 - the preparer suite's fixtures, for test_inputs

NODES = ["gpu-a", "gpu-b"]
WAIT_S = 10.0
REFUSAL_WAIT_S = 5.0
RESEND_S = 1.0  # `Conn.delivered` publishes again after this long without delivery


@dataclass
class Conn:
    """A raw nats-py client and the errors the server sent it (permissions violations among them)."""

    nc: Client
    errors: asyncio.Queue[str]

    async def refused(self, verb: str, subject: str) -> None:
        """Wait for the server's permissions violation naming `subject`."""
        expected = f'permissions violation for {verb} to "{subject}"'.lower()
        seen = []
        try:
            while True:
                error = await asyncio.wait_for(self.errors.get(), REFUSAL_WAIT_S)
                if expected in error.lower():
                    return
                seen.append(error)
        except TimeoutError:
            raise AssertionError(
                f"no refusal of {verb} to {subject!r} within {REFUSAL_WAIT_S}s; errors seen: {seen}"
            ) from None

    async def delivered(self, subject: str, to: Any) -> None:
        """Publish on `subject` (allowed for us) and see the subscription `to` (another client's) get it;
        a refusal the server sends meanwhile fails at once, naming it. Published again every RESEND_S until
        WAIT_S: in loaded full-suite runs a message published right after the other client's flushed
        subscription reached no one, twice (a dead letter here, a request's "no responders" in
        test_nats_permissions), which one more publish does not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        refusal = asyncio.ensure_future(self.errors.get())
        try:
            while True:
                await self.nc.publish(subject, b"{}")
                await self.nc.flush()
                got = asyncio.ensure_future(to.next_msg(timeout=RESEND_S))
                done, _ = await asyncio.wait({got, refusal}, return_when=asyncio.FIRST_COMPLETED)
                if refusal in done:
                    got.cancel()
                    raise AssertionError(f"publish to {subject!r} refused: {refusal.result()}")
                try:
                    message = got.result()
                except nats.errors.TimeoutError:
                    if loop.time() > deadline:
                        raise AssertionError(f"publish to {subject!r}: not delivered within {WAIT_S}s") from None
                    continue
                assert message.subject == subject
                return
        finally:
            refusal.cancel()

    async def request_refused(self, subject: str, body: bytes = b"") -> None:
        """A request on `subject` is refused by the server and no reply comes back: the server's permissions
        violation is awaited (a refused publish is routed nowhere), then a round trip shows no reply arrived."""
        replies = await self.nc.subscribe(self.nc.new_inbox())
        try:
            await self.nc.publish(subject, body, reply=replies.subject)
            await self.refused("publish", subject)
            await self.nc.flush()
            assert replies.delivered == 0 and replies.pending_msgs == 0, f"a reply to the refused {subject!r} came"
        finally:
            await replies.unsubscribe()


async def connect_watched(url: str, **options: Any) -> Conn:
    """A raw client (no reconnect) whose server errors are kept; `options` are nats.connect()'s."""
    errors: asyncio.Queue[str] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        errors.put_nowait(str(exc))

    nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False, connect_timeout=2, **options)
    return Conn(nc, errors)


def url_as(server: EmbeddedNats, user: str) -> str:
    """The server's URL with `user`'s credentials in it (for clients that take only a URL)."""
    return server.url.replace("nats://", f"nats://{user}:{test_password(user)}@", 1)


@contextlib.asynccontextmanager
async def bus_as(server: EmbeddedNats, user: str) -> AsyncIterator[Bus]:
    """A bus connected as the shipped NATS user `user`."""
    bus = await Bus.connect(server.url, name=user, user=user, password=test_password(user), initial_attempts=3)
    try:
        yield bus
    finally:
        await bus.close()


@contextlib.asynccontextmanager
async def provisioned_nats(
    directory: Path, nodes: list[str], readers: dict[str, list[str]] | None = None
) -> AsyncIterator[EmbeddedNats]:
    """nats-server on deploy/nats/nats.conf with the users `nats_users.py` generates for `nodes` (and the
    third-party `readers`, {name: namespaces}); the streams and buckets provisioned by the admin, as the
    deployment's init does."""
    config_dir = nats_layout(directory, nodes, readers)
    store = directory / "js"
    server = ShippedConfigNats(config_dir / "nats.conf", server_env("security-test", store), store)
    await server.start()
    try:
        async with bus_as(server, "admin") as admin:
            await admin.provision()
        yield server
    finally:
        await server.close()


@pytest.fixture
async def shipped_nats(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """The shipped server for NODES, provisioned (`provisioned_nats`)."""
    async with provisioned_nats(tmp_path / "nats", NODES) as server:
        yield server


@pytest.fixture
async def admin_bus(shipped_nats: EmbeddedNats) -> AsyncIterator[Bus]:
    async with bus_as(shipped_nats, "admin") as bus:
        yield bus


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[object]:
    async with apiserver_testing.running_apiserver(tmp_path / "api") as server:
        client = await kube_api_client(str(server.kubeconfig_path))
        try:
            server.client_raw = client  # type: ignore[attr-defined]  # the tests' ApiClient, on the handle
            yield server
        finally:
            await client.close()


class DeadLetters:
    """Dead letters as the admin sees them, awaited one by one."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[DeadLetter] = asyncio.Queue()

    async def next(self, *, reason: str, subject: str) -> DeadLetter:
        """The next dead letter with this reason about this subject (others are skipped)."""
        async with asyncio.timeout(WAIT_S):
            while True:
                letter = await self.queue.get()
                if letter.reason == reason and letter.subject == subject:
                    return letter


@pytest.fixture
async def dead_letters(admin_bus: Bus) -> DeadLetters:
    letters = DeadLetters()

    async def on_letter(letter: DeadLetter, _ctx: object) -> None:
        letters.queue.put_nowait(letter)

    await admin_bus.subscribe(catalog.DEAD_LETTER, on_letter)
    await admin_bus.nc.flush()
    return letters
