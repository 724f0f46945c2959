"""`gpu-dra nats auth-callout`: flags -> CalloutConfig -> answer `$SYS.REQ.USER.AUTH` until stopped.

Owns process wiring only: the issuer key (Secret gpu-dra-nats-auth-callout's `issuer.nk`), the
Kubernetes client that sends TokenReviews (shared.kube.client: kubeconfig or in-cluster), the NATS
connection as the callout's own user of `AUTH` (GPU_DRA_NATS_CREDS; no JetStream, so no
provisioning) and one task per request, so a slow TokenReview delays only its own connect.
Exit codes: 0 after a clean stop, 2 for a bad setting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec

from services.authcallout.service import AuthCallout, kube_token_reviewer, parse_roles
from shared.bus import Bus
from shared.config import CommonConfig, ConfigError
from shared.health import HEALTH
from shared.kube.client import kube_api_client
from shared.logs import get_logger
from shared.natscreds import CALLOUT_SUBJECT
from shared.natsusers import UsersError
from shared.nkeys import KeyPair, NKeyError
from shared.runtime import connect_configured, service_main

log = get_logger(__name__)
DESCRIPTION = "NATS auth callout: node-bound ServiceAccount tokens -> node-scoped NATS users"
QUEUE = "gpu-dra-auth-callout"  # replicas share the requests


def _help(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class CalloutConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    kubeconfig: Annotated[str, _help("kubeconfig file; empty uses in-cluster, then KUBECONFIG or ~/.kube/config")] = ""
    issuer_seed_file: Annotated[
        str, _help("the issuer's NKEY seed (Secret gpu-dra-nats-auth-callout, key issuer.nk)")
    ] = ""
    account: Annotated[
        str, _help("public key of the GPU_DRA account the users are placed in (Secret key `account`)")
    ] = ""
    auth_account: Annotated[str, _help("public key of the AUTH account that calls out (Secret key `auth-account`)")] = (
        ""
    )
    audience: Annotated[str, _help("the audience node tokens must be issued for")] = "nats"
    service_account_roles: Annotated[
        str, _help("which node roles each ServiceAccount may take: NS/SA=role[,role][;...]")
    ] = "gpu-dra/gpu-dra-node=discovery,preparer,cd-agent"
    max_ttl_seconds: Annotated[
        int,
        msgspec.Meta(
            ge=60,
            le=86400,
            description=(
                "a NATS user expires after this (or with its token, if sooner); "
                "the client reconnects with a fresh token"
            ),
        ),
    ] = 3600


def _settings(cfg: CalloutConfig) -> tuple[KeyPair, dict[str, tuple[str, ...]]]:
    """The issuer key and the roles, or ConfigError naming the setting to fix."""
    for name in ("issuer_seed_file", "account", "auth_account", "nats_url", "nats_creds"):
        if not getattr(cfg, name):
            raise ConfigError(f"--{name.replace('_', '-')} is required (see deploy/kubernetes/base/auth-callout.yaml)")
    try:
        issuer = KeyPair.from_seed(Path(cfg.issuer_seed_file).read_text(), "account")
        roles = parse_roles(cfg.service_account_roles)
    except (OSError, NKeyError, UsersError) as exc:
        raise ConfigError(f"{exc}; mount Secret gpu-dra-nats-auth-callout from `gpu-dra nats credentials`") from exc
    return issuer, roles


async def serve(callout: AuthCallout, bus: Bus, stopping: asyncio.Event) -> None:
    """Answer every authorization request on the bus's connection until `stopping` is set."""
    pending: set[asyncio.Task[None]] = set()

    async def one(msg: Any) -> None:
        answer = await callout.answer(msg.data)
        if answer and msg.reply:
            await msg.respond(answer)

    async def on_request(msg: Any) -> None:
        task = asyncio.create_task(one(msg))
        pending.add(task)
        task.add_done_callback(pending.discard)

    sub = await bus.nc.subscribe(CALLOUT_SUBJECT, queue=QUEUE, cb=on_request)
    remove_check = HEALTH.add_check("connected to NATS", lambda: bus.connected)
    log.info("nats auth callout ready", subject=CALLOUT_SUBJECT)
    try:
        await stopping.wait()
    finally:
        remove_check()
        await sub.unsubscribe()
        if pending:
            await asyncio.wait(pending, timeout=5)


async def run(cfg: CalloutConfig, stopping: asyncio.Event) -> None:
    issuer, roles = _settings(cfg)
    api = await kube_api_client(cfg.kubeconfig)
    try:
        callout = AuthCallout(
            issuer=issuer,
            account=cfg.account,
            auth_account=cfg.auth_account,
            roles=roles,
            review=kube_token_reviewer(api),
            audience=cfg.audience,
            max_ttl_s=cfg.max_ttl_seconds,
        )
        bus = await connect_configured(cfg, cfg.nats_url, "auth-callout")
        try:
            await serve(callout, bus, stopping)
        finally:
            await bus.close()
    finally:
        await api.close()


def main(argv: Sequence[str] | None = None) -> int:
    return service_main(
        CalloutConfig,
        argv,
        prog="gpu-dra nats auth-callout",
        description=DESCRIPTION,
        service=lambda _: "auth-callout",
        run=run,
        check=_settings,
    )
