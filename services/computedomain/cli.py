"""`gpu-dra computedomain controller|agent`: flags -> typed config -> run until SIGINT/SIGTERM.

Owns process wiring only: the Kubernetes client (controller: kubeconfig or in-cluster), the NATS
connection (an embedded nats-server when no URL is set), leader election around the controller,
and exit codes (0 ok, 2 bad settings, 1 failed to start), through shared.runtime.service_main.
"""

from __future__ import annotations

import asyncio
import sys

from services.computedomain.config import AgentConfig, ControllerConfig
from shared.bus import BusError
from shared.config import load_config
from shared.kube.client import KubeConfigError, kube_api_client
from shared.logs import get_logger
from shared.runtime import connected_bus, service_main

log = get_logger(__name__)

USAGE = """usage: gpu-dra computedomain <controller|agent> [options]

  controller   ComputeDomain CRs -> claim templates, membership, status (leader-elected)
  agent        per node: the IMEX daemon of the domain this node serves, and its membership

Run 'gpu-dra computedomain <command> --help' for its options."""


async def run_controller(cfg: ControllerConfig, stopping: asyncio.Event) -> None:
    from services.computedomain.controller import Controller
    from services.computedomain.leader import LeaderElector

    api = await kube_api_client(cfg.kubeconfig)
    try:
        async with connected_bus(cfg, "computedomain-controller") as bus:

            async def lead(lost: asyncio.Event) -> None:
                await Controller(
                    api, bus, deletion_timeout=cfg.deletion_timeout, require_assignment=cfg.require_assignment
                ).run(lost)

            if not cfg.leader_election:
                await lead(stopping)
                return
            elector = LeaderElector(
                api,
                namespace=cfg.lease_namespace,
                name=cfg.lease_name,
                identity=cfg.identity,
                lease_duration=cfg.lease_duration,
                renew_deadline=cfg.renew_deadline,
                retry_period=cfg.retry_period,
            )
            await elector.run(stopping, lead)
    finally:
        await api.close()


async def run_agent(cfg: AgentConfig, stopping: asyncio.Event) -> None:
    from services.computedomain.agent import Agent

    async with connected_bus(cfg, f"computedomain-agent-{cfg.node}") as bus:
        await Agent(cfg, bus).run(stopping)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    # a failed start is reported in one line with its cause (exit 1); the traceback is in the log
    failures = ((KubeConfigError, 2), (OSError, 1), (BusError, 1))
    if command == "controller":
        prog = "gpu-dra computedomain controller"
        return service_main(
            ControllerConfig,
            rest,
            prog=prog,
            description="ComputeDomain controller",
            parse=lambda a: load_config(ControllerConfig, a, prog=prog).resolved(),
            service=lambda _: "computedomain-controller",
            run=run_controller,
            failures=failures,
        )
    if command == "agent":
        prog = "gpu-dra computedomain agent"
        return service_main(
            AgentConfig,
            rest,
            prog=prog,
            description="ComputeDomain node agent (IMEX daemons)",
            parse=lambda a: load_config(AgentConfig, a, prog=prog).resolved(),
            service=lambda _: "computedomain-agent",
            run=run_agent,
            failures=failures,
        )
    print(f"gpu-dra computedomain: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
