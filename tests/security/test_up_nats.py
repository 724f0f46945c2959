"""The node-identity attacks against `gpu-dra up`: one local cluster (two nodes, every service its own
process, nats-server with the deployment's users as JWT credentials), attacked with its own node
credentials, the .creds files `up` wrote for gpu-node-0's services.

Each refusal is awaited as its evidence (the publisher's `identity-mismatch` dead letter, the
server's permissions violation) before the effect is checked (gpu-node-1's slices and taints as they
were); each allowed path beside it is shown working, so a refusal is never a broken setup.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
import pytest_asyncio

from embedded.cluster.local import ClusterConfig, LocalCluster
from embedded.cluster.up import main as up_main
from embedded.harness.publisher import node_slices
from shared.bus import Bus
from shared.events import catalog
from shared.events.health import DeviceHealth
from shared.identity import REASON
from shared.natsjwt import Creds
from tests.security.conftest import Conn, DeadLetters, connect_watched

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

OWN, OTHER = "gpu-node-0", "gpu-node-1"  # the attacker holds OWN's credentials; OTHER is the victim
INV = catalog.INVENTORY_BUCKET.name


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    root = tmp_path_factory.mktemp("upnats")
    cfg = ClusterConfig(nodes=2, gpus="h100x2", compute_domains=False, data_dir=str(root / "data"), start_timeout=120)
    async with LocalCluster(cfg) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def dead_letters(cluster: LocalCluster) -> AsyncIterator[DeadLetters]:
    """Dead letters as up's admin identity sees them."""
    assert cluster.bus is not None
    letters = DeadLetters()

    async def on_letter(letter: Any, _ctx: object) -> None:
        letters.queue.put_nowait(letter)

    sub = await cluster.bus.subscribe(catalog.DEAD_LETTER, on_letter)
    await cluster.bus.nc.flush()
    yield letters
    await sub.unsubscribe()


@pytest_asyncio.fixture(loop_scope="module")
async def attacker(cluster: LocalCluster) -> AsyncIterator[Bus]:
    """gpu-node-0's discovery identity, from the .creds file up gave that service."""
    assert cluster.nats_identities is not None
    user = f"discovery.{OWN}"
    bus = await Bus.connect(
        cluster.nats_url, name="attacker", user=user, tls=cluster.nats_identities.tls(user), initial_attempts=3
    )
    yield bus
    await bus.close()


async def _raw(cluster: LocalCluster, user: str) -> Conn:
    """A raw nats-py client signing in with `user`'s .creds, taking replies on its own inbox prefix."""
    assert cluster.nats_identities is not None
    jwt_cb, sign_cb = Creds(cluster.nats_identities.creds[user].read_text()).callbacks()
    return await connect_watched(
        cluster.nats_url, user_jwt_cb=jwt_cb, signature_cb=sign_cb, inbox_prefix=f"_INBOX_{user.replace('.', '_')}"
    )


def devices_and_taints(slices: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {d["name"]: d.get("taints") or [] for s in slices for d in s["spec"].get("devices") or []}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


async def test_every_service_is_its_own_nats_user_given_by_file_and_anonymous_clients_are_refused(
    cluster: LocalCluster,
) -> None:
    assert cluster.supervisor is not None and cluster.nats_identities is not None
    expected = {
        "publisher": "publisher",
        "computedomain-controller": "controller",
        "dashboard": "reader.dashboard",
        "state-gate": "gate",
        **{f"{n}-{role}": f"{role}.{n}" for n in cluster.node_names for role in ("discovery", "preparer")},
    }
    seen = {}
    for child in cluster.supervisor.children:
        env = _environ(child.pid)
        cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes().decode()
        assert ".creds" not in cmdline and "password" not in cmdline.lower(), (child.name, cmdline)
        if child.name in expected:
            user = expected[child.name]
            creds = cluster.nats_identities.creds[user]
            assert env["GPU_DRA_NATS_USER"] == user and env["GPU_DRA_NATS_CREDS"] == str(creds), child.name
            assert stat.S_IMODE(os.stat(creds).st_mode) == 0o600
            seen[child.name] = user
        else:  # the API server, scheduler, controllers, kubelets: no NATS identity at all
            assert env.get("GPU_DRA_NATS_CREDS", "") == "" and env.get("GPU_DRA_NATS_USER", "") == "", child.name
    assert seen == expected
    assert stat.S_IMODE(os.stat(cluster.nats_identities.server_config).st_mode) == 0o600
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
        await nats.connect(cluster.nats_url, allow_reconnect=False, connect_timeout=2)


async def test_an_inventory_naming_another_node_leaves_its_slices_as_they_are(
    cluster: LocalCluster, attacker: Bus, dead_letters: DeadLetters
) -> None:
    api = await cluster.api_client()
    before = devices_and_taints(await node_slices(api, OTHER))
    assert len(before) == 2
    assert cluster.bus is not None
    real = await (await cluster.bus.kv(catalog.INVENTORY_BUCKET)).get(OTHER)
    assert real is not None
    forged = msgspec.structs.replace(real, gpus=real.gpus[:1], content_hash="forged")

    # gpu-node-0's discovery, on its own subject and KV key, says gpu-node-1 has one GPU
    await (await attacker.kv(catalog.INVENTORY_BUCKET)).put(OWN, forged)
    await attacker.publish(catalog.INVENTORY, forged, node=OWN)

    letter = await dead_letters.next(reason=REASON, subject=catalog.INVENTORY.format(node=OWN))
    assert OTHER in letter.error and OWN in letter.error
    assert devices_and_taints(await node_slices(api, OTHER)) == before
    assert len(devices_and_taints(await node_slices(api, OWN))) == 2


async def test_health_naming_another_nodes_gpu_taints_nothing(
    cluster: LocalCluster, attacker: Bus, dead_letters: DeadLetters
) -> None:
    api = await cluster.api_client()
    before = devices_and_taints(await node_slices(api, OTHER))
    assert before and not any(before.values())
    forged = DeviceHealth(
        node=OTHER, device="gpu-1", state="Unhealthy", reason="xid", xid=79, event_id="forged", observed_at=9e9
    )
    await (await attacker.kv(catalog.HEALTH_BUCKET)).put(f"{OWN}.gpu-1", forged)
    await attacker.publish(catalog.HEALTH, forged, node=OWN, device="gpu-1")

    await dead_letters.next(reason=REASON, subject=catalog.HEALTH.format(node=OWN, device="gpu-1"))
    assert devices_and_taints(await node_slices(api, OTHER)) == before


async def test_a_node_user_reads_neither_the_shared_inbox_nor_another_nodes_kv_entry(cluster: LocalCluster) -> None:
    for user in (f"preparer.{OWN}", f"discovery.{OWN}"):
        conn = await _raw(cluster, user)
        try:
            await conn.nc.subscribe("_INBOX.>")
            await conn.nc.flush()
            await conn.refused("subscription", "_INBOX.>")

            other = f"$JS.API.DIRECT.GET.KV_{INV}.$KV.{INV}.{OTHER}"
            await conn.request_refused(other)
            await conn.request_refused(
                f"$JS.API.STREAM.MSG.GET.KV_{INV}", json.dumps({"last_by_subj": f"$KV.{INV}.{OTHER}"}).encode()
            )
            watch = f"$JS.API.CONSUMER.CREATE.KV_{INV}.w.$KV.{INV}.{OTHER}"
            await conn.request_refused(
                watch,
                json.dumps(
                    {"stream_name": f"KV_{INV}", "config": {"name": "w", "filter_subject": f"$KV.{INV}.{OTHER}"}}
                ).encode(),
            )

            # through the state gate: another node's entry refused, its own node's entry read
            gate = f"dra.v1.gate.{OWN}.{user.split('.')[0]}"
            refused = await conn.nc.request(f"{gate}.DIRECT.GET.KV_{INV}.$KV.{INV}.{OTHER}", b"", timeout=5)
            assert (refused.headers or {}).get("Status") == "403" and not refused.data, refused.headers
            own = await conn.nc.request(f"{gate}.DIRECT.GET.KV_{INV}.$KV.{INV}.{OWN}", b"", timeout=5)
            assert (own.headers or {}).get("Nats-Subject") == f"$KV.{INV}.{OWN}" and own.data, own
        finally:
            await conn.nc.close()


async def test_node_names_no_nats_user_can_be_named_after_are_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert up_main(["--node-prefix", "gpu.node-", "--nodes", "1"]) == 2
    assert "--node-prefix 'gpu.node-'" in capsys.readouterr().err


async def test_jetstream_relays_to_another_nodes_subjects_change_nothing_there(
    cluster: LocalCluster, dead_letters: DeadLetters
) -> None:
    """gpu-node-0 keeps a sharing request under its own health key (through the state gate, its only way to
    JetStream) and asks for a push consumer delivering it on gpu-node-1's `set-sharing` subject, and for a
    direct get answered on gpu-node-1's health subject: the server refuses the direct calls, the gate the
    consumer and the foreign reply, and a rollup. The admin's same consumer is delivered, and gpu-node-1's
    discovery refuses it as relayed: its GPU keeps its compute mode, its slices no taint."""
    assert cluster.bus is not None
    api = await cluster.api_client()
    before_slices = devices_and_taints(await node_slices(api, OTHER))
    inventory = await (await cluster.bus.kv(catalog.INVENTORY_BUCKET)).get(OTHER)
    assert inventory is not None and inventory.gpus
    victim_gpu = inventory.gpus[0]
    health_before = await (await cluster.bus.kv(catalog.HEALTH_BUCKET)).items(f"{OTHER}.>")
    conn = await _raw(cluster, f"discovery.{OWN}")
    gate = f"dra.v1.gate.{OWN}.discovery"
    stream, key = f"KV_{catalog.HEALTH_BUCKET.name}", f"$KV.{catalog.HEALTH_BUCKET.name}.{OWN}.share"
    sharing, health = catalog.DEVICE_SET_SHARING.format(node=OTHER), catalog.HEALTH.format(node=OTHER, device="gpu-0")
    try:
        request = json.dumps({"gpu_uuids": [victim_gpu.uuid], "compute_mode": "Prohibited", "timeslice": "Long"})
        stored = await conn.nc.request(f"{gate}.PUB.{key}", request.encode(), timeout=5)
        assert "seq" in json.loads(stored.data)
        body = json.dumps(
            {
                "stream_name": stream,
                "config": {"name": "evil", "filter_subject": key, "deliver_subject": sharing, "ack_policy": "none"},
            }
        )
        await conn.request_refused(f"$JS.API.CONSUMER.CREATE.{stream}.evil.{key}", body.encode())
        refused = await conn.nc.request(f"{gate}.CONSUMER.CREATE.{stream}.evil.{key}", body.encode(), timeout=5)
        assert "own inbox" in json.loads(refused.data)["error"]["description"]
        await conn.nc.publish(f"{gate}.DIRECT.GET.{stream}.{key}", b"", reply=health)  # never answered there
        rollup = await conn.nc.request(f"{gate}.PUB.{key}", b"", headers={"Nats-Rollup": "all"}, timeout=5)
        assert "rollup" in json.loads(rollup.data)["error"]["description"].lower()
        # the probe: the admin may create that consumer; gpu-node-1's discovery refuses what it is handed
        created = await cluster.bus.nc.request(f"$JS.API.CONSUMER.CREATE.{stream}.evil.{key}", body.encode(), timeout=5)
        assert "error" not in json.loads(created.data)
        letter = await dead_letters.next(reason="relayed", subject=key)
        assert OTHER in letter.consumer, letter
    finally:
        await conn.nc.close()
    after = await (await cluster.bus.kv(catalog.INVENTORY_BUCKET)).get(OTHER)
    assert after is not None and after.gpus[0].sharing == victim_gpu.sharing
    assert victim_gpu.sharing.compute_mode == "Default"
    assert devices_and_taints(await node_slices(api, OTHER)) == before_slices
    assert await (await cluster.bus.kv(catalog.HEALTH_BUCKET)).items(f"{OTHER}.>") == health_before
