"""Agents and the channel preparer core on simulated GB200 nodes over a real nats-server."""

from __future__ import annotations

import asyncio
import os
import signal

import nats.errors
import pytest

from services.computedomain.channelcore import (
    CHANNEL_COUNT,
    ChannelClaim,
    ChannelConfigError,
    ChannelConflict,
    ChannelNotReady,
    channel_config,
    parse_channel_config,
)
from services.computedomain.membership import Membership
from shared.bus import BusError
from tests.computedomain.helpers import announce, node_ip, running_nodes

GB200 = "gb200x4:clique=1"


def claim(uid: str, domain: str, mode: str = "Single", ns: str = "ns") -> ChannelClaim:
    return ChannelClaim(
        uid=uid, namespace=ns, name=f"claim-{uid}", config=parse_channel_config(channel_config(domain, mode))
    )


async def test_three_nodes_join_get_channel0_then_leave_without_a_trace(bus, tmp_path):
    await announce(bus, "cd-1")
    async with running_nodes(bus, tmp_path, [GB200] * 3) as nodes:
        edits = await asyncio.gather(*(n.channels.prepare(claim(f"c{i}", "cd-1")) for i, n in enumerate(nodes)))
        assert sorted(e.index for e in edits) == [0, 1, 2]
        for e in edits:
            assert [d.path for d in e.device_nodes] == ["/dev/nvidia-caps-imex-channels/channel0"]
            assert e.device_nodes[0].minor == 0 and e.clique_id.endswith(".1")
            assert "COMPUTE_DOMAIN_UUID=cd-1" in e.env
        members = await Membership(bus).members("cd-1")
        assert {m.status for m in members.values()} == {"Ready"}
        # every daemon's hosts file names all three peers by DNS index
        for n in nodes:
            hosts = (n.root / "domains" / "cd-1" / "hosts").read_text()
            assert all(node_ip(i) in hosts for i in range(3))
        pids = [n.daemon.pid for n in nodes]
        for i, n in enumerate(nodes):
            assert await n.channels.unprepare(f"c{i}", "cd-1") is True
        assert await Membership(bus).members("cd-1") == {}
        for pid in pids:
            assert pid is not None
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert not (nodes[0].root / "domains" / "cd-1").exists()


async def test_second_domain_on_a_busy_node_is_refused_and_the_first_is_unaffected(bus, tmp_path):
    await announce(bus, "cd-a")
    await announce(bus, "cd-b", name="other")
    async with running_nodes(bus, tmp_path, [GB200]) as nodes:
        (node,) = nodes
        await node.channels.prepare(claim("a1", "cd-a"))
        with pytest.raises(ChannelConflict, match=r"already serves ComputeDomain ns/cd .*one ComputeDomain at a time"):
            await node.channels.prepare(claim("b1", "cd-b"))
        assert (await Membership(bus).members("cd-a"))["node-0"].status == "Ready"
        assert await Membership(bus).members("cd-b") == {}
        assert node.domain.uid == "cd-a" and node.domain.claims == {"a1"}
        # the same domain again (a second pod of the workload) is fine; the wrong namespace is not
        await node.channels.prepare(claim("a2", "cd-a"))
        with pytest.raises(Exception, match="must be in its domain's namespace"):
            await node.channels.prepare(claim("a3", "cd-a", ns="elsewhere"))
        assert await node.channels.unprepare("a1", "cd-a") is False  # a2 still holds the domain
        assert await node.channels.unprepare("a2", "cd-a") is True


async def test_killed_daemon_is_restarted_and_its_peers_are_told(bus, tmp_path):
    await announce(bus, "cd-k")
    async with running_nodes(bus, tmp_path, [GB200] * 2) as nodes:
        first = await asyncio.gather(*(n.channels.prepare(claim(f"k{i}", "cd-k")) for i, n in enumerate(nodes)))
        victim, peer = nodes[1].daemon, nodes[0].daemon
        reloads_before = peer.reloads
        ms = Membership(bus)
        seen: list[str] = []

        async def follow() -> None:
            async for _d, node, m in ms.watch("cd-k"):
                if node == "node-1" and m is not None:
                    seen.append(m.status)
                    if seen[-2:] == ["NotReady", "Ready"]:
                        return

        watcher = asyncio.create_task(follow())
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        await asyncio.wait_for(watcher, 10)
        assert victim.restarts == 1
        # the peer's agent sees the same Ready and signals its daemon to redial
        await asyncio.wait_for(peer.wait_signalled(reloads_before), 10)
        # a new claim on the restarted node is served at once
        again = await nodes[1].channels.prepare(claim("k1b", "cd-k"))
        assert again.index == first[1].index  # the restart kept the node's DNS index


async def test_a_join_whose_membership_listing_times_out_is_retryable_and_the_retry_joins(bus, tmp_path, monkeypatch):
    await announce(bus, "cd-t")
    async with running_nodes(bus, tmp_path, [GB200]) as nodes:
        answering = bus.js.stream_info

        async def loaded(name, *args, **kwargs):  # a server too loaded to answer a listing in time
            if kwargs.get("subjects_filter"):
                raise nats.errors.TimeoutError
            return await answering(name, *args, **kwargs)

        monkeypatch.setattr(bus.js, "stream_info", loaded)
        with pytest.raises(ChannelNotReady, match=r"did not answer listing .*kubelet retries"):
            await nodes[0].channels.prepare(claim("t0", "cd-t"))
        monkeypatch.setattr(bus.js, "stream_info", answering)
        assert nodes[0].agent.domain is None and await Membership(bus).members("cd-t") == {}
        edits = await nodes[0].channels.prepare(claim("t0", "cd-t"))
        assert edits.index == 0 and nodes[0].agent.domain is not None


async def test_a_failed_peer_watch_is_watched_again_and_the_next_peer_is_not_missed(bus, tmp_path, monkeypatch):
    await announce(bus, "cd-w")
    async with running_nodes(bus, tmp_path, [GB200] * 2) as nodes:
        membership = nodes[0].agent.membership
        following = membership.watch
        watches = 0

        async def breaks_after_its_replay(uid=None):  # a NATS outage right after the first replay
            nonlocal watches
            watches += 1
            async for item in following(uid):
                yield item
                if watches == 1 and item[1] == "":
                    raise nats.errors.TimeoutError

        monkeypatch.setattr(membership, "watch", breaks_after_its_replay)
        await nodes[0].channels.prepare(claim("w0", "cd-w"))
        signalled = nodes[0].daemon.reloads
        await nodes[1].channels.prepare(claim("w1", "cd-w"))
        # node 0 watched again, learnt of node 1 and told its daemon
        await asyncio.wait_for(nodes[0].daemon.wait_signalled(signalled), 10)
        assert watches >= 2 and sorted(nodes[0].domain.peers.values()) == sorted([node_ip(0), node_ip(1)])


async def test_a_ready_report_that_nats_does_not_take_is_written_again(bus, tmp_path, monkeypatch):
    await announce(bus, "cd-r")
    async with running_nodes(bus, tmp_path, [GB200], ready_timeout=10) as nodes:
        membership = nodes[0].agent.membership
        writing = membership.set_status
        refused: list[str] = []

        async def refused_once(member, status):  # a NATS outage as the daemon turns Ready
            if not refused:
                refused.append(status)
                raise BusError("KV put dra-cd-members failed 3 times over 30s (TimeoutError: nats: timeout)")
            return await writing(member, status)

        monkeypatch.setattr(membership, "set_status", refused_once)
        await nodes[0].channels.prepare(claim("r0", "cd-r"))  # answers once the member is Ready in KV
        assert refused == ["Ready"]
        assert (await Membership(bus).members("cd-r"))["node-0"].status == "Ready"


async def test_a_membership_read_nats_does_not_answer_is_not_ready_and_retried(bus, tmp_path, monkeypatch):
    await announce(bus, "cd-m")
    async with running_nodes(bus, tmp_path, [GB200]) as nodes:
        channels = nodes[0].channels
        reading = channels.membership.member

        async def unanswered(*args, **kwargs):
            raise BusError("open KV bucket dra-cd-members failed 4 times over 30s (TimeoutError: nats: timeout)")

        monkeypatch.setattr(channels.membership, "member", unanswered)
        with pytest.raises(ChannelNotReady, match=r"NATS did not answer .*kubelet retries"):
            await channels.prepare(claim("m0", "cd-m"))
        monkeypatch.setattr(channels.membership, "member", reading)
        assert (await channels.prepare(claim("m0", "cd-m"))).index == 0


async def test_all_mode_gives_every_channel_and_non_fabric_nodes_get_none(bus, tmp_path):
    await announce(bus, "cd-all")
    await announce(bus, "cd-plain")
    async with running_nodes(bus, tmp_path, [GB200, "h100x2"]) as nodes:
        edits = await nodes[0].channels.prepare(claim("x", "cd-all", mode="All"))
        assert len(edits.device_nodes) == CHANNEL_COUNT == 2048
        assert edits.device_nodes[-1].path.endswith("/channel2047") and edits.device_nodes[-1].minor == 2047
        assert edits.to_cdi()["deviceNodes"][5]["type"] == "c"
        plain = await nodes[1].channels.prepare(claim("y", "cd-plain"))
        assert plain.device_nodes == [] and plain.clique_id == "" and plain.index == -1


async def test_unknown_domain_is_retryable_and_bad_configs_are_permanent(bus, tmp_path):
    async with running_nodes(bus, tmp_path, [GB200], ready_timeout=0.5) as nodes:
        with pytest.raises(ChannelNotReady, match="not known"):
            await nodes[0].channels.prepare(claim("z", "cd-missing"))
        assert nodes[0].agent.domain is None
    with pytest.raises(ChannelConfigError, match="strict decoding error"):
        parse_channel_config({**channel_config("u"), "extra": 1})
    with pytest.raises(ChannelConfigError, match="domainID is empty"):
        parse_channel_config(channel_config(""))
    with pytest.raises(ChannelConfigError, match="allocationMode"):
        parse_channel_config(channel_config("u", "Some"))


async def test_a_stand_in_supervisor_gets_the_daemons_files_and_its_signals(bus, tmp_path):
    # Agent(supervisor=...) builds the stand-in with ImexSupervisor's keywords (what the benchmark's
    # in-process daemons use) and drives it as it drives a daemon: start, reload on new peers, stop.
    made: list[StandIn] = []
    reloaded = asyncio.Event()

    class StandIn:
        def __init__(self, **keywords: object) -> None:
            self.keywords = keywords
            self.calls: list[str] = []
            made.append(self)

        async def start(self) -> None:
            self.calls.append("start")
            await self.keywords["on_ready"](True)  # type: ignore[operator]

        async def stop(self) -> None:
            self.calls.append("stop")

        def reload(self) -> None:
            self.calls.append("reload")
            reloaded.set()

        def restart(self) -> None:
            self.calls.append("restart")

    await announce(bus, "cd-1")
    async with running_nodes(bus, tmp_path, [GB200] * 2, supervisor=StandIn) as nodes:
        first = await nodes[0].channels.prepare(claim("c0", "cd-1"))
        assert first.index == 0 and made[0].keywords["config"] == nodes[0].domain.files.config
        await nodes[1].channels.prepare(claim("c1", "cd-1"))
        await asyncio.wait_for(reloaded.wait(), 10)  # node 0's stand-in hears of node 1
        assert {m.status for m in (await Membership(bus).members("cd-1")).values()} == {"Ready"}
        assert await nodes[0].channels.unprepare("c0", "cd-1") is True
        assert made[0].calls[0] == "start" and made[0].calls[-1] == "stop" and "reload" in made[0].calls
        assert not (nodes[0].root / "domains" / "cd-1" / "imexd.pid").exists()
