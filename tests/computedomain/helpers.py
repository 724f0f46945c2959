"""Test helpers: a NATS-backed little world of nodes with discovery and computedomain agents."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from embedded.cluster.local import node_ip as node_ip  # re-exported: the tests name nodes by it
from embedded.harness.discovery import running_discovery
from services.computedomain import crd
from services.computedomain.agent import Agent, _Domain
from services.computedomain.channelcore import ChannelClaim, ChannelEdits, ChannelNotReady, ChannelPreparer
from services.computedomain.config import AgentConfig
from services.computedomain.imex import DaemonSupervisor, ImexSupervisor
from shared.bus import Bus
from shared.events.base import now_unix
from shared.events.catalog import CD_STATUS
from shared.events.computedomain import DomainStatusChanged
from shared.ports import free_port


@dataclass
class Node:
    name: str
    agent: Agent
    channels: ChannelPreparer
    root: Path

    @property
    def domain(self) -> _Domain:
        """The domain this node's agent serves; the test fails when it serves none."""
        assert self.agent.domain is not None, f"{self.name} serves no domain"
        return self.agent.domain

    @property
    def daemon(self) -> ImexSupervisor:
        """That domain's IMEX daemon supervisor; the test fails when there is none."""
        daemon = self.domain.supervisor
        assert isinstance(daemon, ImexSupervisor), f"{self.name} runs no IMEX daemon"
        return daemon


async def install_crds(kube: ApiClient, namespace: str = "ns") -> None:
    """The ComputeDomain CRDs and `namespace` in a bare API server."""
    ext = client.ApiextensionsV1Api(kube)
    for body in crd.crds():
        await ext.create_custom_resource_definition(body)  # type: ignore[arg-type]  # the client sends dicts as they are
    await client.CoreV1Api(kube).create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]


async def announce(bus: Bus, uid: str, name: str = "cd", namespace: str = "ns") -> None:
    """What the controller publishes when it first sees a domain."""
    await bus.publish(
        CD_STATUS,
        DomainStatusChanged(
            domain_uid=uid,
            domain_name=name,
            domain_namespace=namespace,
            status="NotReady",
            nodes=0,
            observed_at=now_unix(),
        ),
        domain_uid=uid,
    )


@contextlib.asynccontextmanager
async def running_nodes(
    bus: Bus,
    tmp_path: Path,
    specs: list[str],
    *,
    port: int | None = None,
    ready_timeout: float = 30.0,
    per_node: Sequence[dict[str, object]] = (),
    supervisor: Callable[..., DaemonSupervisor] | None = None,
    **agent_overrides: object,
) -> AsyncIterator[list[Node]]:
    """One discovery + agent (+ the channel preparer core) per spec, e.g. ["gb200x4:clique=1"] * 3; the
    agents run the simulated daemon unless `agent_overrides` say otherwise; `per_node[i]`: node i's own."""
    port = port or free_port()
    nodes: list[Node] = []
    async with contextlib.AsyncExitStack() as stack:
        stopping = asyncio.Event()
        tasks = []
        for i, spec in enumerate(specs):
            name = f"node-{i}"
            await stack.enter_async_context(running_discovery(bus, name, simulate=spec, root=tmp_path / "sim"))
            cfg = AgentConfig(
                node=name,
                ip_address=node_ip(i),
                state_dir=str(tmp_path / "agents" / name),
                imex_server_port=port,
                imex_cmd_port=port + 1,
                **{"imex_daemon": "simulated", **agent_overrides, **(per_node[i] if i < len(per_node) else {})},  # type: ignore[arg-type]
            ).resolved()
            agent = Agent(cfg, bus, supervisor=supervisor)
            tasks.append(asyncio.create_task(agent.run(stopping)))
            await agent.ready.wait()
            nodes.append(
                Node(
                    name,
                    agent,
                    ChannelPreparer(
                        bus,
                        node=name,
                        dev_root=str(tmp_path / "sim" / name),
                        ready_timeout=ready_timeout,
                        simulated=True,
                    ),
                    tmp_path / "agents" / name,
                )
            )
        try:
            yield nodes
        finally:
            stopping.set()
            await asyncio.gather(*tasks, return_exceptions=True)


async def spawn_computedomain(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    """`python -m services.computedomain ARGS` as a real process in its own session, output discarded."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.computedomain",
        *args,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )


async def prepare_when_agent_answers(channels: ChannelPreparer, claim: ChannelClaim) -> ChannelEdits:
    """Prepare once the agent process serves requests (kubelet retries the same way while it starts)."""
    for _ in range(100):
        try:
            return await channels.prepare(claim)
        except ChannelNotReady:
            await asyncio.sleep(0.1)
    raise AssertionError("agent never prepared the claim")


async def wait_for_object(
    custom, group: str, version: str, namespace: str, plural: str, name: str, predicate, timeout: float = 15.0
):
    """The object once `predicate(obj or None)` holds (None: it is gone), by watching, not polling."""
    from kubernetes_asyncio import watch
    from kubernetes_asyncio.client.exceptions import ApiException

    async def _wait():
        while True:
            listed = await custom.list_namespaced_custom_object(
                group, version, namespace, plural, field_selector=f"metadata.name={name}"
            )
            items = listed.get("items") or []
            current = items[0] if items else None
            if predicate(current):
                return current
            try:
                async with watch.Watch() as stream:
                    async for event in stream.stream(
                        custom.list_namespaced_custom_object,
                        group,
                        version,
                        namespace,
                        plural,
                        field_selector=f"metadata.name={name}",
                        resource_version=listed["metadata"]["resourceVersion"],
                        timeout_seconds=30,
                    ):
                        obj = None if event["type"] == "DELETED" else event["object"]
                        if predicate(obj):
                            return obj
            except ApiException as exc:
                if exc.status != 410:
                    raise

    return await asyncio.wait_for(_wait(), timeout)
