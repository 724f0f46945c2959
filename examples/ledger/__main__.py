"""`python -m examples.ledger`: flags -> LedgerService; also `--report` to print a saved ledger."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from . import store
from .accounting import LedgerFileError
from .consumer import DEFAULT_DURABLE, LedgerService
from .schema import ContractError, load_contract


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.ledger",
                                     description="Per-namespace GPU-seconds from the driver's claim lifecycle events.")
    parser.add_argument("--schemas", type=Path, required=True,
                        help="directory written by `gpu-dra events schema --out DIR`")
    parser.add_argument("--nats", default=os.environ.get("GPU_DRA_NATS_URL") or os.environ.get("NATS_URL")
                        or "nats://127.0.0.1:4222",
                        help="NATS URL (default $GPU_DRA_NATS_URL as `gpu-dra up` prints it, $NATS_URL, or "
                             "nats://127.0.0.1:4222)")
    parser.add_argument("--creds", default=os.environ.get("NATS_CREDS") or os.environ.get("GPU_DRA_NATS_CREDS") or None,
                        help="NATS .creds file of the reader user the operator issued (default $NATS_CREDS, "
                             "then $GPU_DRA_NATS_CREDS)")
    parser.add_argument("--inbox-prefix", default=os.environ.get("NATS_INBOX_PREFIX") or None,
                        help="where replies come: the `_INBOX_<identity>` the reader user may subscribe to")
    parser.add_argument("--state", type=Path, default=Path("gpu-seconds-ledger.json"),
                        help="ledger file, replaced atomically after each batch")
    parser.add_argument("--durable", default=DEFAULT_DURABLE, help="durable consumer name")
    parser.add_argument("--namespace", help="account only this namespace")
    parser.add_argument("--report", action="store_true", help="print the saved ledger as JSON and exit")
    return parser.parse_args(argv)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        contract = load_contract(args.schemas)
        if args.report:
            ledger = await store.load(args.state, contract.retention_s)
            print(json.dumps(ledger.report(now=time.time()), indent=2, sort_keys=True))
            return 0
        service = LedgerService(args.nats, contract, args.state, durable=args.durable, namespace=args.namespace,
                                credentials=args.creds, inbox_prefix=args.inbox_prefix)
        await service.start()
    except (ContractError, LedgerFileError, RuntimeError) as exc:
        print(f"ledger: {exc}", file=sys.stderr)
        return 2
    task = asyncio.create_task(service.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await service.close()
    print(json.dumps(service.ledger.report(now=time.time()), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
