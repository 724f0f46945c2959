"""The `compute-domain.nvidia.com` kubelet plugin end to end: claims in the embedded API server, the preparer on
its real unix sockets called by the kubelet emulator, and discovery + the computedomain agent (with its simulated
IMEX daemon) on a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from embedded.apiserver.testing import running_apiserver
from services.computedomain.agent import clique_of
from services.computedomain.channelcore import channel_config
from services.computedomain.crd import CHANNEL_DEVICE_CLASS
from services.computedomain.membership import Membership, wait_for_status
from services.preparer.host.claims import KubeClaimSource
from shared.bus import Bus
from shared.deviceclasses import CD_DRIVER
from shared.events.catalog import CD_AGENT_JOIN, INVENTORY_BUCKET
from shared.events.computedomain import DomainMember
from tests.computedomain.helpers import Node, announce, node_ip, running_nodes
from tests.preparer.cdischema import spec_errors
from tests.preparer.helpers import ApiClaims, claim_doc, cleanup, running_node, short_root
from tests.preparer.helpers import Node as PreparerNode

GB200 = "gb200x4:clique=1"
NODE = "node-0"  # what running_nodes calls its first node
NS = "default"
CHANNEL0 = "/dev/nvidia-caps-imex-channels/channel0"


@pytest.fixture
def root() -> Any:
    path = short_root()
    try:
        yield path
    finally:
        cleanup(path)


def channel_claim(name: str, domain_uid: str, mode: str = "Single") -> dict[str, Any]:
    """A claim from the domain's workload template (request `channel`, the opaque channel config), allocated
    channel-0 on node-0 as the scheduler would."""
    doc = claim_doc(
        name=name,
        namespace=NS,
        node=NODE,
        driver=CD_DRIVER,
        results=[("channel", "channel-0")],
        configs=[
            {
                "source": "FromClaim",
                "requests": ["channel"],
                "opaque": {"driver": CD_DRIVER, "parameters": channel_config(domain_uid, mode)},
            }
        ],
    )
    doc["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = CHANNEL_DEVICE_CLASS
    return doc


@contextlib.asynccontextmanager
async def world(
    bus: Bus, root: Path, tmp_path: Path, domains: dict[str, str], **overrides: Any
) -> AsyncIterator[tuple[ApiClaims, Node, PreparerNode, Any]]:
    """Announced domains (uid -> name), one GB200 node with discovery and agent, claims in the API server, and the
    channel driver's preparer on its real sockets, registered like the kubelet does."""
    for uid, name in domains.items():
        await announce(bus, uid, name=name, namespace=NS)
    async with (
        running_nodes(bus, tmp_path, [GB200]) as nodes,
        running_apiserver(root / "api") as api,
        api.client() as client,
    ):
        async with running_node(
            KubeClaimSource(client), root, bus=bus, node=NODE, driver=CD_DRIVER, **overrides
        ) as prep:
            yield ApiClaims(client), nodes[0], prep, client


def checkpoint_claims(prep: PreparerNode) -> dict[str, Any]:
    return json.loads((prep.service.plugin_dir / "checkpoint.json").read_text())["preparedClaims"]


def cdi_spec(prep: PreparerNode, uid: str) -> dict[str, Any]:
    return json.loads((prep.cdi_dir / f"k8s.compute-domain.nvidia.com-claim_{uid}.json").read_text())


def assert_valid_cdi(spec: dict[str, Any]) -> None:
    assert spec_errors(spec) == []


@contextlib.asynccontextmanager
async def counting_joins(bus: Bus) -> AsyncIterator[Any]:
    """Every join request sent to node-0's agent, seen by a second plain subscriber on the subject."""
    sub = await bus.nc.subscribe(CD_AGENT_JOIN.format(node=NODE))
    await bus.nc.flush()

    async def count() -> int:
        await bus.nc.flush()  # a request answered before this flush was delivered here before its PONG
        return sub.pending_msgs

    try:
        yield count
    finally:
        await sub.unsubscribe()


async def test_channel_claim_over_the_real_socket_gets_channel0_and_unprepare_removes_everything(
    spans: InMemorySpanExporter, bus: Bus, root: Path, tmp_path: Path
) -> None:
    async with world(bus, root, tmp_path, {"cd-1": "cd"}) as (claims, node, prep, _):
        assert prep.plugin.driver == CD_DRIVER
        assert prep.service.registration_socket == root / "reg" / "compute-domain.nvidia.com-reg.sock"
        assert prep.service.dra_socket == root / "plugins" / "compute-domain.nvidia.com" / "dra.sock"
        claim = await claims.add(channel_claim("workload", "cd-1"))
        spans.clear()
        result = (await prep.plugin.prepare([claim]))[claim.uid]
        assert result.error == ""
        (device,) = result.devices
        assert (device.device, device.pool, device.request_names) == ("channel-0", NODE, ["channel"])
        assert device.cdi_device_ids == [f"k8s.compute-domain.nvidia.com/claim={claim.uid}-channel-0"]
        spec = cdi_spec(prep, claim.uid)
        assert_valid_cdi(spec)
        assert spec["kind"] == "k8s.compute-domain.nvidia.com/claim"
        (cdi_device,) = spec["devices"]
        assert cdi_device["name"] == f"{claim.uid}-channel-0"
        (channel,) = cdi_device["containerEdits"]["deviceNodes"]
        assert channel["path"] == CHANNEL0 and channel["hostPath"].endswith(CHANNEL0)
        assert (channel["type"], channel["minor"], channel["fileMode"]) == ("c", 0, 0o666)
        assert "COMPUTE_DOMAIN_UUID=cd-1" in cdi_device["containerEdits"]["env"]
        assert checkpoint_claims(prep)[claim.uid]["state"] == "PrepareCompleted"
        assert node.agent.domain is not None and node.domain.claims == {claim.uid}

        # one trace: the kubelet's client span -> the plugin's server span -> the agent serving the join over NATS
        finished = spans.get_finished_spans()
        client_span = next(s for s in finished if s.name == "kubelet NodePrepareResources")
        in_trace = {s.name: s for s in finished if s.context.trace_id == client_span.context.trace_id}
        server = in_trace["NodePrepareResources"]
        assert server.parent is not None and server.parent.span_id == client_span.context.span_id
        assert {"claim.prepare", "channel.prepare", "serve cd-agent-join", "cdi.write"} <= set(in_trace)
        assert in_trace["claim.prepare"].events[0].name == "claim.get"  # the claim's read, an event of its span

        assert await prep.plugin.unprepare([claim]) == {claim.uid: ""}
        assert prep.cdi_files() == []
        assert claim.uid not in checkpoint_claims(prep)
        assert node.agent.domain is None  # the last claim went: the daemon stopped and the node left
        assert await Membership(bus).members("cd-1") == {}
        assert await prep.plugin.unprepare([claim]) == {claim.uid: ""}  # again: a no-op


async def test_a_daemon_not_ready_yet_is_a_retryable_error_and_the_next_call_succeeds(
    bus: Bus, root: Path, tmp_path: Path
) -> None:
    async with world(bus, root, tmp_path, {"cd-r": "cd"}, channel_ready_timeout=1.0) as (claims, node, prep, _):
        # a peer that joined the domain but whose daemon never answers keeps node-0's daemon NotReady
        inventory = await (await bus.kv(INVENTORY_BUCKET)).get(NODE)
        assert inventory is not None
        ghost = await Membership(bus).join(
            DomainMember(
                domain_uid="cd-r",
                domain_name="cd",
                domain_namespace=NS,
                node="ghost",
                ip_address=node_ip(7),
                clique_id=clique_of(inventory),
                index=-1,
            )
        )
        claim = await claims.add(channel_claim("early", "cd-r"))
        first = (await prep.plugin.prepare([claim]))[claim.uid]
        assert "not ready in ComputeDomain default/cd" in first.error and "kubelet retries" in first.error
        assert first.devices == [] and prep.cdi_files() == []
        assert checkpoint_claims(prep)[claim.uid]["state"] == "PrepareStarted"  # the join stays in place
        daemon = node.daemon
        pid = daemon.pid

        await Membership(bus).leave(ghost, reason="test: the peer went away")
        assert await wait_for_status(Membership(bus), "cd-r", NODE, "Ready", 10.0) is not None
        second = (await prep.plugin.prepare([claim]))[claim.uid]
        assert second.error == ""
        assert second.devices[0].cdi_device_ids == [f"k8s.compute-domain.nvidia.com/claim={claim.uid}-channel-0"]
        assert cdi_spec(prep, claim.uid)["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] == CHANNEL0
        assert checkpoint_claims(prep)[claim.uid]["state"] == "PrepareCompleted"
        # the retry resumed the wait: the same daemon, never restarted
        assert daemon.pid == pid and daemon.restarts == 0 and node.domain.claims == {claim.uid}
        assert await prep.plugin.unprepare([claim]) == {claim.uid: ""}


async def test_a_second_domain_on_the_node_fails_clearly_and_leaves_the_first_prepared(
    bus: Bus, root: Path, tmp_path: Path
) -> None:
    async with world(bus, root, tmp_path, {"cd-a": "cd-a", "cd-b": "cd-b"}) as (claims, node, prep, _):
        first = await claims.add(channel_claim("a", "cd-a"))
        second = await claims.add(channel_claim("b", "cd-b"))
        prepared = (await prep.plugin.prepare([first]))[first.uid]
        assert prepared.error == ""
        first_spec = cdi_spec(prep, first.uid)

        refused = (await prep.plugin.prepare([second]))[second.uid]
        assert refused.devices == []
        assert "already serves ComputeDomain default/cd-a" in refused.error
        assert "one ComputeDomain at a time" in refused.error
        # nothing of the second domain is on the node, and the first is untouched
        assert prep.cdi_files() == [f"k8s.compute-domain.nvidia.com-claim_{first.uid}.json"]
        assert cdi_spec(prep, first.uid) == first_spec
        assert set(checkpoint_claims(prep)) == {first.uid}
        assert node.domain.uid == "cd-a" and node.domain.claims == {first.uid}
        assert (await Membership(bus).members("cd-a"))[NODE].status == "Ready"
        assert await Membership(bus).members("cd-b") == {}
        assert (await prep.plugin.prepare([first]))[first.uid] == prepared
        assert await prep.plugin.unprepare([second]) == {second.uid: ""}  # the kubelet's cleanup: a no-op
        assert node.domain.claims == {first.uid}

        # once the first domain's workload is gone, the node serves the second, with its own channel
        assert await prep.plugin.unprepare([first]) == {first.uid: ""}
        retried = (await prep.plugin.prepare([second]))[second.uid]
        assert retried.error == ""
        env = cdi_spec(prep, second.uid)["devices"][0]["containerEdits"]["env"]
        assert "COMPUTE_DOMAIN_UUID=cd-b" in env and "COMPUTE_DOMAIN_UUID=cd-a" not in env
        assert prep.cdi_files() == [f"k8s.compute-domain.nvidia.com-claim_{second.uid}.json"]
        assert await prep.plugin.unprepare([second]) == {second.uid: ""}


async def test_a_restarted_preparer_keeps_the_claim_and_prepares_it_again_without_a_second_join(
    bus: Bus, root: Path, tmp_path: Path
) -> None:
    async with world(bus, root, tmp_path, {"cd-s": "cd"}) as (claims, node, prep, client), counting_joins(bus) as joins:
        claim = await claims.add(channel_claim("survivor", "cd-s"))
        before = (await prep.plugin.prepare([claim]))[claim.uid]
        assert before.error == "" and await joins() == 1
        await prep.plugin.close()
        await prep.service.stop()
        assert not prep.service.registration_socket.exists()

        async with running_node(KubeClaimSource(client), root, bus=bus, node=NODE, driver=CD_DRIVER) as again:
            assert checkpoint_claims(again)[claim.uid]["state"] == "PrepareCompleted"
            after = (await again.plugin.prepare([claim]))[claim.uid]
            assert after == before
            assert await joins() == 1  # answered from the checkpoint: the agent was not asked again
            assert cdi_spec(again, claim.uid)["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] == CHANNEL0
            assert node.domain.claims == {claim.uid}

            assert await again.plugin.unprepare([claim]) == {claim.uid: ""}
            assert again.cdi_files() == [] and checkpoint_claims(again) == {}
            assert node.agent.domain is None


async def test_the_preparer_process_serves_both_drivers_on_their_own_sockets(root: Path) -> None:
    from services.preparer.config import parse

    cfg = parse(
        [
            "--node",
            NODE,
            "--registry-dir",
            str(root / "reg"),
            "--plugins-dir",
            str(root / "plugins"),
            "--cdi-dir",
            str(root / "cdi"),
        ]
    )
    assert cfg.drivers == ["gpu.nvidia.com", CD_DRIVER]
    from embedded.kubelet.client import register
    from services.preparer.host.service import PreparerService
    from tests.preparer.helpers import MemoryClaims

    services = [PreparerService(cfg, MemoryClaims(), driver=d) for d in cfg.drivers]
    for service in services:
        await service.start()
    try:
        registered = sorted(p.name for p in (root / "reg").glob("*-reg.sock"))
        assert registered == ["compute-domain.nvidia.com-reg.sock", "gpu.nvidia.com-reg.sock"]
        for service in services:
            plugin = await register(service.registration_socket)
            try:
                assert plugin.driver == service.driver
                assert Path(plugin.endpoint) == root / "plugins" / service.driver / "dra.sock"
                assert await asyncio.wait_for(plugin.prepare([]), 10) == {}  # the kubelet's health probe
            finally:
                await plugin.close()
        assert (root / "plugins" / CD_DRIVER / "checkpoint.json").exists()
        assert (root / "plugins" / "gpu.nvidia.com" / "checkpoint.json").exists()
    finally:
        for service in services:
            await service.stop()
