"""`gpu-dra nats`: run an embedded nats-server with JetStream until interrupted;
`gpu-dra nats credentials`: the deployment's NATS credentials (shared.natscreds);
`gpu-dra nats auth-callout`: the auth callout service (services/authcallout)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from shared.natsserver import EmbeddedNats
from shared.runtime import stop_event


async def _run(store: Path | None, port: int) -> None:
    async with EmbeddedNats(store_dir=store, port=port) as srv:
        print(f"nats ready url={srv.url} store={srv.store_dir}", flush=True)
        await stop_event().wait()


def main(argv: list[str]) -> int:
    if argv[:1] == ["credentials"]:
        from shared.natscreds import main as credentials

        return credentials(argv[1:])
    if argv[:1] == ["auth-callout"]:
        from services.authcallout.cli import main as auth_callout

        return auth_callout(argv[1:])
    parser = argparse.ArgumentParser(prog="gpu-dra nats", description="embedded nats-server with JetStream")
    parser.add_argument("--store-dir", type=Path, default=None, help="JetStream store (default: a temp dir)")
    parser.add_argument("--port", type=int, default=0, help="client port (default: a free one)")
    args = parser.parse_args(argv)
    asyncio.run(_run(args.store_dir, args.port))
    return 0
