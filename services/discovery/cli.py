"""`gpu-dra discovery`: one-shot inventory (`--once --output json`), the long-running service, and
the `inject-xid` sub-action. Owns argument handling and exit codes (0 ok, 1 request failed,
2 bad input, 3 NVML unavailable)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import msgspec

from services.discovery import config
from services.discovery.machine import MachineError
from services.discovery.nvml import NvmlUnavailable
from services.discovery.service import Scanner, open_nvml, run_service
from shared.bus import BusError
from shared.events import catalog
from shared.events.devices import InjectXidRequest
from shared.natstarget import TargetError, add_target_flags, connect, resolve_target
from shared.runtime import connected_bus, service_main


def _fail(msg: str, code: int) -> int:
    print(f"gpu-dra discovery: error: {msg}", file=sys.stderr)
    return code


async def _once(cfg: config.DiscoveryConfig) -> int:
    nvml = open_nvml(cfg)
    await nvml.start()
    try:
        inv = await Scanner(cfg, nvml).scan()
    finally:
        await nvml.close()
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(inv)).decode() + "\n")
    return 0


async def _serve(cfg: config.DiscoveryConfig, stopping: asyncio.Event) -> int:
    if cfg.once:
        return await _once(cfg)
    async with connected_bus(cfg, f"discovery-{cfg.node}") as bus:
        await run_service(cfg, bus, stopping)
    return 0


def _inject_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu-dra discovery inject-xid",
        description="Raise a simulated XID (or GPU lost, or recovery) on a running node.",
    )
    p.add_argument("--node", required=True)
    p.add_argument("--device", required=True, help="device name (gpu-0, a MIG device name) or UUID")
    p.add_argument("--xid", type=int, default=0)
    p.add_argument("--gpu-lost", action="store_true")
    p.add_argument("--recover", action="store_true")
    p.add_argument("--timeout", type=float, default=5.0)
    add_target_flags(p)  # --nats-url/--creds/--user/--data-dir; else the env or the running local cluster
    return p


async def inject_xid(argv: list[str]) -> int:
    ns = _inject_parser().parse_args(argv)
    if not (ns.xid > 0 or ns.gpu_lost or ns.recover):
        return _fail("give --xid N (> 0), --gpu-lost or --recover", 2)
    try:
        target = resolve_target(ns, dict(os.environ))
    except TargetError as exc:
        return _fail(str(exc), 2)
    try:
        bus = await connect(target, f"inject-xid-{ns.node}")
    except BusError as exc:  # NATS out of reach, or its credentials unreadable: fix the target, exit 2
        return _fail(str(exc), 2)
    try:
        ref = ns.device
        inv = await (await bus.kv(catalog.INVENTORY_BUCKET)).get(ns.node)
        if inv is not None:
            for g in inv.gpus:
                ref = g.uuid if g.name == ns.device else ref
                for m in g.mig_devices:
                    ref = m.uuid if m.name == ns.device else ref
        req = InjectXidRequest(gpu_uuid=ref, xid=ns.xid, gpu_lost=ns.gpu_lost, recover=ns.recover)
        reply = await bus.request(catalog.DEVICE_INJECT_XID, req, timeout=ns.timeout, node=ns.node)
    finally:
        await bus.close()
    if not reply.ok:
        return _fail(f"{reply.error.code}: {reply.error.message}" if reply.error else "refused", 1)
    print(f"injected on {ns.node}/{ns.device}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "inject-xid":
        try:
            return asyncio.run(inject_xid(args[1:]))
        except SystemExit as exc:  # argparse: message already printed
            return int(exc.code or 0) if not isinstance(exc.code, str) else _fail(exc.code, 2)
        except (TimeoutError, OSError, BusError) as exc:
            return _fail(f"{type(exc).__name__}: {exc}", 1)
    return service_main(
        config.DiscoveryConfig,
        args,
        prog="gpu-dra discovery",
        description=config.DESCRIPTION,
        parse=config.parse,
        service=lambda cfg: f"discovery-{cfg.node}",
        run=_serve,
        failures=((MachineError, 2), (NvmlUnavailable, 3), (TimeoutError, 1), (OSError, 1), (BusError, 1)),
    )


if __name__ == "__main__":
    raise SystemExit(main())
