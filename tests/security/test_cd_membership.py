"""ComputeDomain membership under the shipped NATS users: each node's agent joins through the real
membership code (bids for indices included) with only its own `cd-agent.<node>` rights, and cannot
write another node's membership or index bid."""

from __future__ import annotations

import asyncio

import msgspec
import nats.errors
import pytest

from services.computedomain.membership import Membership, index_key, member_key
from shared.bus import encode
from shared.events import catalog
from shared.events.computedomain import DomainMember
from shared.natsserver import EmbeddedNats
from tests.security.conftest import bus_as

UID = "5f0c7a52-cd01-4d7e-9d7a-1f2e3d4c5b6a"
CLIQUE = "fabric-1.0"


def member(node: str) -> DomainMember:
    return DomainMember(domain_uid=UID, domain_name="cd", domain_namespace="team-a", node=node,
                        ip_address=f"10.0.0.{1 + ord(node[-1]) - ord('a')}", clique_id=CLIQUE, index=-1)


async def test_agents_join_and_leave_a_domain_with_only_their_own_nats_rights(shipped_nats: EmbeddedNats) -> None:
    async with bus_as(shipped_nats, "cd-agent.gpu-a") as bus_a, bus_as(shipped_nats, "cd-agent.gpu-b") as bus_b, \
            bus_as(shipped_nats, "controller") as controller:
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


@pytest.mark.parametrize("key", [member_key(UID, "gpu-a"), index_key(UID, CLIQUE, 0, "gpu-a")],
                         ids=["membership", "index-bid"])
async def test_an_agent_cannot_write_another_nodes_membership_or_index_bid(
        shipped_nats: EmbeddedNats, key: str) -> None:
    async with bus_as(shipped_nats, "cd-agent.gpu-b") as hostile, bus_as(shipped_nats, "admin") as admin:
        forged = msgspec.structs.replace(member("gpu-a"), index=0, status="Ready")
        subject = f"$KV.{catalog.CD_MEMBERS_BUCKET.name}.{key}"
        with pytest.raises(nats.errors.TimeoutError):  # refused by the server: no stream ack comes back
            await hostile.js.publish(subject, encode(forged), timeout=1.0)
        assert await Membership(admin).members(UID) == {}
        assert await Membership(admin).holders(UID, CLIQUE) == {}
        # the same write for its own node is allowed (the refusal is about the key, not a broken setup)
        own = key.replace("gpu-a", "gpu-b")
        await hostile.js.publish(f"$KV.{catalog.CD_MEMBERS_BUCKET.name}.{own}",
                                 encode(msgspec.structs.replace(forged, node="gpu-b")), timeout=2.0)
