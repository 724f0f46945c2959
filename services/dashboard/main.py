"""`gpu-dra dashboard`: the live fleet page and its API, on one watch set and the bus.

Flags (and GPU_DRA_* variables): --listen, --kubeconfig, --nats-url and the other NATS settings, --auth
none|kubernetes, --trace-url-template, --span-store. Exit 2 for a bad setting, 3 when the Kubernetes
client cannot be configured or the API server cannot be asked what it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from importlib.metadata import entry_points
from typing import Annotated, Any, Literal

import msgspec

from services.dashboard import allocmetrics
from services.dashboard.auth import authenticator
from services.dashboard.server import make_app, parse_listen, serve
from services.dashboard.state import DiscoveryError, FleetState, discover
from shared.bus import Bus
from shared.config import CommonConfig
from shared.health import HEALTH
from shared.kube.client import KubeConfigError, kube_api_client
from shared.kube.informer import until_synced
from shared.kube.resources import Kube
from shared.logs import get_logger
from shared.runtime import connect_configured, nats_url_or_embedded, service_main
from shared.tasks import cancel_and_wait

log = get_logger(__name__)
TOOLS_GROUP = "gpu_dra.dashboard_tools"
DEFAULT_LISTEN = "127.0.0.1:8765"
DESCRIPTION = (
    "The live fleet page: every node, GPU, MIG device, claim and ComputeDomain, pushed to the browser "
    "within a second of a change (docs/dashboard.md)."
)


class DashboardConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    listen: Annotated[
        str, msgspec.Meta(description=("HOST:PORT to serve the page and API on (port 0: a free one, printed)"))
    ] = DEFAULT_LISTEN
    kubeconfig: Annotated[
        str,
        msgspec.Meta(
            description=("kubeconfig file; empty: in-cluster credentials, else $KUBECONFIG or ~/.kube/config")
        ),
    ] = ""
    auth: Annotated[
        Literal["none", "kubernetes"],
        msgspec.Meta(
            description=(
                "none: everyone sees every namespace (local use); kubernetes: a viewer's bearer token is checked by "
                "TokenReview and sees the claims of the namespaces where it may list resourceclaims"
            )
        ),
    ] = "none"
    trace_url_template: Annotated[
        str,
        msgspec.Meta(
            description=(
                "a tracing UI's URL for a trace, {traceId} replaced, e.g. http://localhost:16686/trace/{traceId}"
            )
        ),
    ] = ""
    span_store: Annotated[
        str,
        msgspec.Meta(
            description=(
                "a local span-store file (JSON lines, as `gpu-dra up` writes traces.jsonl): claims show their waterfall"
            )
        ),
    ] = ""

    def __post_init__(self) -> None:
        parse_listen(self.listen)
        if self.trace_url_template and "{traceId}" not in self.trace_url_template:
            raise ValueError(f"--trace-url-template {self.trace_url_template!r} has no {{traceId}} to replace")


def local_tools() -> Any:
    """The drill-down tools (`explainer`, `reasoner`, `waterfall`) a local-cluster install registers in the
    `gpu_dra.dashboard_tools` entry-point group (embedded/cluster/dashboardtools.py), else None: the drill-down
    uses that code rather than a copy, and a production image, without it, answers 501."""
    for point in entry_points(group=TOOLS_GROUP):
        try:
            return point.load()
        except ImportError:
            continue
    return None


@contextlib.asynccontextmanager
async def reading_bus(cfg: DashboardConfig) -> AsyncIterator[Bus]:
    """The bus as a reader (no provisioning: the reader role may create no stream); not ready while lost."""
    buses: list[Bus] = []
    remove_check = HEALTH.add_check("connected to NATS", lambda: any(bus.connected for bus in buses))
    try:
        async with nats_url_or_embedded(cfg) as url:
            bus = await connect_configured(cfg, url, "dashboard")
            buses.append(bus)
            try:
                yield bus
            finally:
                await bus.close()
    finally:
        remove_check()


async def _run(cfg: DashboardConfig, stopping: asyncio.Event) -> None:
    api = await kube_api_client(cfg.kubeconfig)
    try:
        kube = Kube(api)
        tools = local_tools()
        state = FleetState(kube, **await discover(kube), reasoner=tools.reasoner(kube) if tools else None)
        synced = asyncio.Event()
        HEALTH.add_check("fleet listed", synced.is_set)
        async with reading_bus(cfg) as bus, allocmetrics.exported(state):
            await state.subscribe_bus(bus)
            app = make_app(
                state,
                auth=authenticator(cfg.auth, api),
                trace_url_template=cfg.trace_url_template,
                explainer=tools.explainer(cfg.kubeconfig) if tools else None,
                waterfall=tools.waterfall(cfg.span_store) if tools else None,
            )
            watching = asyncio.create_task(state.run(stopping, synced), name="dashboard-state")
            try:
                if not await until_synced([synced], stopping):
                    return
                async with serve(app, cfg.listen) as (host, port):  # once the fleet is listed: no empty page
                    print(f"dashboard: http://{host}:{port}/", flush=True)
                    log.info("serving", url=f"http://{host}:{port}/", auth=cfg.auth)
                    await stopping.wait()
            finally:
                await cancel_and_wait([watching])
    finally:
        await api.close()


def main(argv: list[str] | None = None) -> int:
    return service_main(
        DashboardConfig,
        argv,
        prog="gpu-dra dashboard",
        description=DESCRIPTION,
        service=lambda cfg: "dashboard",
        run=_run,
        failures=((KubeConfigError, 2), (DiscoveryError, 3)),
    )
