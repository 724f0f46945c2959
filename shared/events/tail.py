"""`gpu-dra events tail`: watch the driver's events, live or replayed, one line each (or JSON).

Where to connect, first found: `--nats-url` (with `--creds`/`--user`); the environment
(GPU_DRA_NATS_URL, GPU_DRA_NATS_CREDS, GPU_DRA_NATS_USER: the lines `gpu-dra up` prints); `--data-dir`
of a local cluster; the newest local cluster still running (its `nats.json`). `--since 10m` replays
the DRA_EVENTS stream from then on through an ordered consumer (nothing is stored for us); without
it only new events show. Filters narrow the subjects subscribed to, not what is printed. A reader that goes
away (`| head -2`) ends it quietly, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
from collections.abc import Iterable
from typing import Any, get_args

import msgspec
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from shared.events.catalog import CATALOG, CLAIM, DEAD_LETTER, EVENTS_STREAM, Entry
from shared.events.claims import ClaimEventKind
from shared.natstarget import Target, add_target_flags, connect, resolve_target

CLAIM_STEPS: tuple[str, ...] = get_args(ClaimEventKind)
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)\Z", re.ASCII)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class TailError(ValueError):
    """Bad flags or no NATS to connect to; the message says what to do."""


def parse_duration(text: str) -> float:
    found = _DURATION.match(text.strip())
    if not found:
        raise TailError(f"--since {text!r}: give a number and a unit, e.g. 30s, 10m, 2h, 1d")
    return float(found[1]) * _UNITS[found[2]]


def subjects(entries: Iterable[Entry], node: str, namespace: str, kind: str) -> list[str]:
    """The subscription subjects for the filters (an empty list: the filters exclude every event)."""
    out = []
    for entry in entries:
        if entry.pattern != "event" or entry is DEAD_LETTER:
            continue
        if not entry.durable and kind != entry.name:
            continue  # telemetry: every node every few seconds, only when asked for by name
        tokens = {}
        if kind and kind != entry.name:
            if entry is not CLAIM or kind not in CLAIM_STEPS:
                continue
            tokens["event"] = kind
        if node:
            if "node" not in entry.tokens:
                continue
            tokens["node"] = node
        if namespace:
            if "namespace" not in entry.tokens:
                continue
            tokens["namespace"] = namespace
        out.append(entry.wildcard(**tokens))
    return out


def _entry_of(subject: str) -> Entry | None:
    for entry in CATALOG:
        if entry.parse(subject) is not None:
            return entry
    return None


def _trace_id(headers: dict[str, str]) -> str:
    parts = headers.get("traceparent", "").split("-")
    return parts[1] if len(parts) == 4 else ""


def _summary(entry: Entry | None, body: dict[str, Any]) -> str:
    if entry is CLAIM:
        devices = ",".join(d.get("device", "") for d in body.get("devices", []))
        text = f"{body.get('event')} {body.get('claim_namespace')}/{body.get('claim_name')} on {body.get('node')}"
        text += f" [{devices}]" if devices else ""
        return text + (f" reason={body['reason']}: {body.get('error', '')}" if body.get("reason") else "")
    keys = ("node", "device", "state", "xid", "domain_name", "status", "nodes", "reason")
    return " ".join(f"{k}={body[k]}" for k in keys if body.get(k) not in (None, "", 0))


def render(msg: Msg, as_json: bool) -> str:
    headers = dict(msg.headers or {})
    entry = _entry_of(msg.subject)
    try:
        body = msgspec.json.decode(msg.data)
    except msgspec.DecodeError:
        body = {"undecodable": msg.data[:200].decode("utf-8", "replace")}
    observed = (
        headers.get("ce-time")
        or datetime.datetime.fromtimestamp(float(body.get("observed_at") or 0), datetime.UTC).isoformat()
    )
    record = {
        "time": observed,
        "type": headers.get("ce-type", entry.name if entry else ""),
        "id": headers.get("ce-id", ""),
        "subject": msg.subject,
        "trace_id": _trace_id(headers),
        "data": body,
    }
    if as_json:
        return json.dumps(record, separators=(",", ":"))
    name = entry.name if entry else "?"
    trace = f" trace={record['trace_id']}" if record["trace_id"] else ""
    return f"{observed} {name:<18} {_summary(entry, body)}{trace}"


async def tail(
    target: Target, filters: list[str], *, since_s: float | None, count: int, as_json: bool, out: Any
) -> int:
    bus = await connect(target, "events-tail")
    seen = 0
    done = asyncio.Event()
    lock = asyncio.Lock()

    async def show(msg: Msg) -> None:
        nonlocal seen
        async with lock:
            if done.is_set():
                return
            try:
                print(render(msg, as_json), file=out, flush=True)
            except BrokenPipeError:  # the reader is gone (`| head -2`): the end, quietly
                _discard_output(out)
                done.set()
                return
            seen += 1
            if count and seen >= count:
                done.set()

    try:
        for subject in filters:
            if since_s is None:
                await bus.nc.subscribe(subject, cb=show)
            else:
                start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=since_s)
                await bus.js.subscribe(
                    subject,
                    stream=EVENTS_STREAM.name,
                    cb=show,
                    ordered_consumer=True,
                    deliver_policy=DeliverPolicy.BY_START_TIME,
                    config=ConsumerConfig(opt_start_time=start),
                )
        await done.wait()
    finally:
        await bus.close()
    return 0


def _discard_output(out: Any) -> None:
    """Point `out`'s file descriptor at /dev/null, so that nothing written later (the flush at exit) fails."""
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def add_parser(sub: Any) -> None:
    tail_args = sub.add_parser("tail", help="watch events (live, or replayed with --since), one line each")
    tail_args.add_argument("--since", help="replay from this long ago first (e.g. 10m, 2h)")
    tail_args.add_argument("--node", default="", help="only events of this node")
    tail_args.add_argument("--namespace", default="", help="only claim events of this namespace")
    tail_args.add_argument(
        "--type",
        default="",
        help="a catalog event name (claim-lifecycle, device-health, ...) or a claim step (prepared, unprepared, ...)",
    )
    tail_args.add_argument("-o", "--output", choices=("line", "json"), default="line")
    tail_args.add_argument("--count", type=int, default=0, help="stop after this many events (0: never)")
    add_target_flags(tail_args)


def run(args: argparse.Namespace, out: Any) -> int:
    known = {e.name for e in CATALOG if e.pattern == "event" and e is not DEAD_LETTER} | set(CLAIM_STEPS)
    if args.type and args.type not in known:
        raise TailError(f"--type {args.type!r}: not an event name; known: {', '.join(sorted(known))}")
    since = parse_duration(args.since) if args.since else None
    if since is not None and any(e.name == args.type and not e.durable for e in CATALOG):
        raise TailError(f"--type {args.type} is not stored (core NATS only): drop --since to watch it live")
    filters = subjects(CATALOG, args.node, args.namespace, args.type)
    if not filters:
        raise TailError("the filters exclude every event (e.g. --namespace with a --type that has no namespace)")
    target = resolve_target(args, dict(os.environ))
    try:
        return asyncio.run(
            tail(target, filters, since_s=since, count=args.count, as_json=args.output == "json", out=out)
        )
    except KeyboardInterrupt:
        return 0
