"""ComputeDomain membership under the shipped NATS users: each node's agent joins through the real
membership code (bids for indices included) with only its own `cd-agent.<node>` rights, and cannot
write another node's membership or index bid."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import pytest
from kubernetes_asyncio import client as kube

from embedded.harness.discovery import running_discovery
from services.computedomain import crd
from services.computedomain.agent import Agent
from services.computedomain.assignments import Assigner
from services.computedomain.channelcore import (
    ChannelClaim,
    ChannelPreparer,
    channel_config,
    parse_channel_config,
)
from services.computedomain.config import AgentConfig
from services.computedomain.membership import Membership, MembershipError, index_key, member_key, token
from shared.bus import Bus, encode
from shared.events import catalog
from shared.events.computedomain import DomainMember
from shared.identity import REASON
from shared.natsserver import EmbeddedNats
from shared.ports import free_port
from shared.tasks import cancel_and_wait
from tests.computedomain.helpers import announce, prepare_when_agent_answers
from tests.polling import eventually
from tests.security.conftest import DeadLetters, bus_as

UID = "5f0c7a52-cd01-4d7e-9d7a-1f2e3d4c5b6a"
CLIQUE = "fabric-1.0"


def member(node: str) -> DomainMember:
    return DomainMember(
        domain_uid=UID,
        domain_name="cd",
        domain_namespace="team-a",
        node=node,
        ip_address=f"10.0.0.{1 + ord(node[-1]) - ord('a')}",
        clique_id=CLIQUE,
        index=-1,
    )


async def test_agents_join_and_leave_a_domain_with_only_their_own_nats_rights(shipped_nats: EmbeddedNats) -> None:
    async with (
        bus_as(shipped_nats, "cd-agent.gpu-a") as bus_a,
        bus_as(shipped_nats, "cd-agent.gpu-b") as bus_b,
        bus_as(shipped_nats, "controller") as controller,
    ):
        joined = await asyncio.gather(Membership(bus_a).join(member("gpu-a")), Membership(bus_b).join(member("gpu-b")))
        assert sorted(m.index for m in joined) == [0, 1]
        seen = await Membership(controller).members(UID)
        assert {n: m.index for n, m in seen.items()} == {m.node: m.index for m in joined}
        assert await Membership(controller).holders(UID, CLIQUE) == {m.index: m.node for m in joined}
        # a second join keeps the index the node holds
        again = await Membership(bus_a).join(member("gpu-a"))
        assert again.index == joined[0].index
        await Membership(bus_a).leave(again, reason="test")
        assert set(await Membership(controller).members(UID)) == {"gpu-b"}
        assert await Membership(controller).holders(UID, CLIQUE) == {joined[1].index: "gpu-b"}
        # the freed index is the next one taken
        rejoined = await Membership(bus_a).join(member("gpu-a"))
        assert rejoined.index == joined[0].index


@pytest.mark.parametrize(
    "key", [member_key(UID, "gpu-a"), index_key(UID, CLIQUE, 0, "gpu-a")], ids=["membership", "index-bid"]
)
async def test_an_agent_cannot_write_another_nodes_membership_or_index_bid(
    shipped_nats: EmbeddedNats, key: str
) -> None:
    async with bus_as(shipped_nats, "cd-agent.gpu-b") as hostile, bus_as(shipped_nats, "admin") as admin:
        forged = msgspec.structs.replace(member("gpu-a"), index=0, status="Ready")
        subject = f"$KV.{catalog.CD_MEMBERS_BUCKET.name}.{key}"
        with pytest.raises(nats.js.errors.APIError, match="may not"):  # refused by the state gate
            await hostile.js.publish(subject, encode(forged), timeout=2.0)
        assert await Membership(admin).members(UID) == {}
        assert await Membership(admin).holders(UID, CLIQUE) == {}
        # the same write for its own node is allowed (the refusal is about the key, not a broken setup)
        own = key.replace("gpu-a", "gpu-b")
        await hostile.js.publish(
            f"$KV.{catalog.CD_MEMBERS_BUCKET.name}.{own}",
            encode(msgspec.structs.replace(forged, node="gpu-b")),
            timeout=2.0,
        )


async def _files(agent: Agent) -> dict[str, str]:
    """The IMEX daemon's peer files of the domain the agent serves (nodes config and hosts)."""
    assert agent.domain is not None
    files = agent.domain.files
    return {path.name: path.read_text() for path in (files.nodes, files.hosts) if path.exists()}


async def test_an_agent_cannot_join_a_domain_not_assigned_to_its_node(
    shipped_nats: EmbeddedNats, tmp_path: Path, dead_letters: DeadLetters
) -> None:
    """gpu-a's agent serves a domain the controller assigned to gpu-a only; gpu-b's agent, with valid
    node creds, writes itself into that domain (membership and index bid): it is no member for the
    controller nor for gpu-a, the IMEX nodes config does not change, and the write is dead-lettered
    `identity-mismatch`. Once the controller assigns gpu-b, the same membership counts."""
    members_key = f"$KV.{catalog.CD_MEMBERS_BUCKET.name}.{member_key(UID, 'gpu-b')}"
    async with contextlib.AsyncExitStack() as stack:
        bus = {
            user: await stack.enter_async_context(bus_as(shipped_nats, user))
            for user in ("controller", "discovery.gpu-a", "cd-agent.gpu-a", "preparer.gpu-a", "cd-agent.gpu-b")
        }
        await stack.enter_async_context(
            running_discovery(bus["discovery.gpu-a"], "gpu-a", simulate="gb200x4:clique=1", root=tmp_path / "sim")
        )
        controller = Membership(bus["controller"], require_assignment=True)
        await announce(bus["controller"], UID, namespace="team-a")
        await controller.assign(UID, "gpu-a", ["team-a/workload-a"])
        cfg = AgentConfig(
            node="gpu-a",
            ip_address="127.0.0.1",
            state_dir=str(tmp_path / "agent-a"),
            imex_server_port=free_port(),
            imex_cmd_port=free_port(),
            imex_daemon="simulated",
            require_assignment=True,
        ).resolved()
        agent = Agent(cfg, bus["cd-agent.gpu-a"])
        stopping = asyncio.Event()
        run = asyncio.create_task(agent.run(stopping))
        try:
            await agent.ready.wait()
            channels = ChannelPreparer(
                bus["preparer.gpu-a"],
                node="gpu-a",
                dev_root=str(tmp_path / "sim" / "gpu-a"),
                ready_timeout=20,
                simulated=True,
            )
            await prepare_when_agent_answers(
                channels, ChannelClaim("claim-a", "team-a", "workload-a", parse_channel_config(channel_config(UID)))
            )
            assert agent.domain is not None and agent.domain.member.index == 0
            peers_before, files_before = dict(agent.domain.peers), await _files(agent)

            # the attack: gpu-b's agent writes itself into the domain, bidding for index 0 too
            hostile = Membership(bus["cd-agent.gpu-b"])  # a hostile agent runs whatever code it likes
            clique = agent.domain.member.clique_id
            forged = msgspec.structs.replace(member("gpu-b"), clique_id=clique, ip_address="10.6.6.6", status="Ready")
            await hostile.join(forged)
            await dead_letters.next(reason=REASON, subject=members_key)
            assert set(await controller.members(UID)) == {"gpu-a"}
            assert await controller.holders(UID, clique) == {0: "gpu-a"}
            assert await Membership(bus["controller"]).holders(UID, clique) == {0: "gpu-a", 1: "gpu-b"}  # it did bid
            assert agent.domain.peers == peers_before and await _files(agent) == files_before

            # the same membership counts once the controller assigns the domain to gpu-b
            await controller.assign(UID, "gpu-b", ["team-a/workload-b"])
            async with asyncio.timeout(10):
                async for _d, node, value in controller.watch(UID):
                    if node == "gpu-b" and value is not None:
                        break
            domain = agent.domain

            async def written() -> bool:  # the agent's own watch applies it right after, then writes its files
                return len(domain.peers) == 2 and "10.6.6.6" in "".join((await _files(agent)).values())

            await eventually(written, "gpu-b in the agent's peers and in its IMEX files", timeout=10)
        finally:
            stopping.set()
            await run


async def _assignment_changes(bus: Bus) -> AsyncGenerator[tuple[set[str], str], None]:
    """(nodes the domain is assigned to, what changed) at each change of its assignment keys."""
    bucket = await bus.kv(catalog.CD_MEMBERS_BUCKET)
    watcher = await bucket.open_watch(f"{token(UID)}.assign.*")
    nodes: set[str] = set()
    try:
        while True:
            entry = await asyncio.wait_for(watcher.next(), 10)
            if entry is None:
                yield set(nodes), "replayed"
                continue
            node = entry.key.rsplit(".", 1)[1]
            if entry.operation in ("DEL", "PURGE"):
                nodes.discard(node)
                yield set(nodes), f"unassigned {node}"
            else:
                nodes.add(node)
                yield set(nodes), f"assigned {node}"
    finally:
        await watcher.stop()


def _channel_claim(name: str, node: str) -> dict[str, Any]:
    """A ResourceClaim allocated on `node` with a channel of the domain, as the scheduler writes it."""
    config = {
        "source": "FromClaim",
        "requests": [],
        "opaque": {"driver": crd.DRIVER, "parameters": channel_config(UID)},
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {
            "devices": {
                "requests": [{"name": "channel", "exactly": {"deviceClassName": crd.CHANNEL_DEVICE_CLASS}}],
                "config": [config],
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "channel", "driver": crd.DRIVER, "pool": node, "device": "channel-0"}],
                    "config": [config],
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                },
            }
        },
    }


async def test_the_controller_assigns_a_domain_to_the_nodes_of_its_allocated_channel_claims(
    shipped_nats: EmbeddedNats, api: Any
) -> None:
    custom = kube.CustomObjectsApi(api.client_raw)
    async with bus_as(shipped_nats, "controller") as bus:
        membership = Membership(bus, require_assignment=True)
        assigner = asyncio.create_task(Assigner(api.client_raw, membership).run())
        changes = _assignment_changes(bus)
        try:
            async with asyncio.timeout(10):
                assert await anext(changes) == (set(), "replayed")
                await kube.CoreV1Api(api.client_raw).create_namespace({"metadata": {"name": "team-a"}})  # type: ignore[arg-type]  # the client sends a dict as it is
                doc = _channel_claim("workload-a", "gpu-a")
                created = await custom.create_namespaced_custom_object(
                    "resource.k8s.io", "v1", "team-a", "resourceclaims", doc
                )
                await custom.patch_namespaced_custom_object_status(
                    "resource.k8s.io",
                    "v1",
                    "team-a",
                    "resourceclaims",
                    "workload-a",
                    {"status": doc["status"]},
                    _content_type="application/merge-patch+json",
                )  # type: ignore[call-arg]  # not in its stubs
                assert await anext(changes) == ({"gpu-a"}, "assigned gpu-a")
                assert created["metadata"]["uid"]
                await custom.delete_namespaced_custom_object(
                    "resource.k8s.io", "v1", "team-a", "resourceclaims", "workload-a"
                )
                assert await anext(changes) == (set(), "unassigned gpu-a")
        finally:
            await changes.aclose()
            await cancel_and_wait([assigner])


async def test_an_unassigned_nodes_early_bids_do_not_take_indices(shipped_nats: EmbeddedNats) -> None:
    """gpu-b's agent bids for every index of a domain assigned only to gpu-a before gpu-a joins:
    with assignments required, gpu-a still gets index 0 and gpu-b holds none."""
    async with (
        bus_as(shipped_nats, "cd-agent.gpu-a") as bus_a,
        bus_as(shipped_nats, "cd-agent.gpu-b") as bus_b,
        bus_as(shipped_nats, "controller") as controller,
    ):
        await Membership(controller).assign(UID, "gpu-a", ["team-a/workload-a"])
        squatter = Membership(bus_b, max_per_clique=2)  # without the check, a clique of 2 would be full
        for index in range(2):
            await bus_b.js.publish(
                f"$KV.{catalog.CD_MEMBERS_BUCKET.name}.{index_key(UID, CLIQUE, index, 'gpu-b')}",
                encode(msgspec.structs.replace(member("gpu-b"), index=index)),
                timeout=2.0,
            )
        assert await squatter.holders(UID, CLIQUE) == {0: "gpu-b", 1: "gpu-b"}
        with pytest.raises(MembershipError, match="already has 2 nodes"):
            await Membership(bus_a, max_per_clique=2).join(member("gpu-a"))
        joined = await Membership(bus_a, max_per_clique=2, require_assignment=True).join(member("gpu-a"))
        assert joined.index == 0
        assert await Membership(controller, require_assignment=True).holders(UID, CLIQUE) == {0: "gpu-a"}
