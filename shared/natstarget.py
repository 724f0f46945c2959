"""Which NATS an operator's command talks to (`gpu-dra events tail`, `gpu-dra discovery inject-xid`).

First found: `--nats-url` (with `--creds`/`--user`); the environment (GPU_DRA_NATS_URL,
GPU_DRA_NATS_CREDS, GPU_DRA_NATS_USER: the lines `gpu-dra up` prints); `--data-dir` of a local
cluster; the newest local cluster still running. A local cluster's `<data-dir>/nats.json` (0600,
written by `gpu-dra up`) holds its URL and up's own credential.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.bus import Bus

LOCAL_CLUSTER_FILE = "nats.json"  # written by `gpu-dra up` into its data dir


class TargetError(ValueError):
    """No NATS to connect to, or a local cluster's file that does not say one; the message says what to do."""


@dataclass(frozen=True)
class Target:
    url: str
    creds: str = ""
    user: str = ""


def add_target_flags(parser: Any) -> None:
    parser.add_argument("--nats-url", default="")
    parser.add_argument("--creds", default="", help="NATS .creds file")
    parser.add_argument("--user", default="", help="NATS user (names the inbox prefix with --creds)")
    parser.add_argument("--data-dir", default="", help="a local cluster's data dir (`gpu-dra up --data-dir`)")


def _from_file(path: Path) -> Target:
    try:
        data = json.loads(path.read_text())
        return Target(url=str(data["url"]), creds=str(data.get("creds", "")), user=str(data.get("user", "")))
    except (OSError, ValueError, KeyError) as exc:
        raise TargetError(f"{path}: not a local cluster's NATS file ({exc}); is `gpu-dra up` running?") from None


def _newest_local_cluster() -> Path | None:
    """The nats.json of the newest `gpu-dra up` data dir (named after its pid) whose `up` still runs."""
    found = []
    for path in Path(tempfile.gettempdir()).glob("gpu-dra-cluster-*/" + LOCAL_CLUSTER_FILE):
        pid = path.parent.name.removeprefix("gpu-dra-cluster-").split("-", 1)[0]
        if pid.isdigit() and Path(f"/proc/{pid}").exists():
            found.append((path.stat().st_mtime, path))
    return max(found)[1] if found else None


def resolve_target(args: argparse.Namespace, env: dict[str, str]) -> Target:
    if args.nats_url:
        return Target(args.nats_url, args.creds, args.user)
    if env.get("GPU_DRA_NATS_URL"):
        return Target(
            env["GPU_DRA_NATS_URL"],
            args.creds or env.get("GPU_DRA_NATS_CREDS", ""),
            args.user or env.get("GPU_DRA_NATS_USER", ""),
        )
    if args.data_dir:
        return _from_file(Path(args.data_dir) / LOCAL_CLUSTER_FILE)
    newest = _newest_local_cluster()
    if newest is None:
        raise TargetError(
            "no NATS to connect to: pass --nats-url (and --creds), set GPU_DRA_NATS_URL as `gpu-dra up` "
            "prints it, or pass --data-dir of a local cluster"
        )
    return _from_file(newest)


async def connect(target: Target, name: str) -> Bus:
    """A Bus to `target` for an operator's command: three tries, then BusError (out of reach, or its credentials
    unreadable), so the operator is told at once rather than left waiting."""
    from shared.bus import Bus, NatsTLS  # the bus only for commands that connect

    tls = NatsTLS(creds_file=target.creds) if target.creds else None
    return await Bus.connect(target.url, name=name, user=target.user or None, tls=tls, initial_attempts=3)
