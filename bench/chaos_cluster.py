"""The chaos run's cluster (bench/chaos.py), as a user runs it: `gpu-dra up` as a process of its own,
its console read as it comes and its services found in /proc (the targets of the kills); the admin's
API client, remade whenever the API server restarts; and the admin's login to the cluster's NATS, to
read DRA_EVENTS."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
from nats.errors import TimeoutError as NatsTimeout

from shared.kube.client import kube_api_client
from shared.kube.resources import Kube
from shared.kube.rest import ApiError
from shared.natsjwt import Creds

REPO = Path(__file__).resolve().parents[1]
NS = "default"
CLUSTER_TARGETS = ("publisher", "scheduler", "apiserver", "nats-server")
NODE_TARGETS = ("preparer", "discovery", "kubelet")


def log(line: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {line}", flush=True)


class UpProcess:
    """`gpu-dra up` in its own session; its console is kept and searched as it comes."""

    def __init__(self, data_dir: Path, nodes: int, gpus: str, metrics_port: int) -> None:
        self.data_dir = data_dir
        self.kubeconfig = data_dir / "kubeconfig"
        self.argv = [
            sys.executable,
            "-m",
            "shared.cli",
            "up",
            "--nodes",
            str(nodes),
            "--gpus",
            gpus,
            "--data-dir",
            str(data_dir),
            "--metrics-port",
            str(metrics_port),
            "--no-compute-domains",
        ]
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self.stamps: list[float] = []  # wall time each line was read
        self._new = asyncio.Condition()
        self._reader: asyncio.Task[None] | None = None

    async def start(self, timeout: float) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = asyncio.create_task(self._read())
        await self.wait_line(lambda line: line.startswith("ready:"), timeout)

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            async with self._new:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self.stamps.append(time.time())
                self._new.notify_all()
        async with self._new:
            self.lines.append("\0")  # EOF
            self.stamps.append(time.time())
            self._new.notify_all()

    async def wait_line(self, match: Callable[[str], bool], timeout: float) -> str:
        async def first() -> str:
            async with self._new:
                while True:
                    for line in self.lines:
                        if line == "\0":
                            raise RuntimeError("gpu-dra up exited:\n" + "\n".join(self.lines[-40:]))
                        if match(line):
                            return line
                    await self._new.wait()

        return await asyncio.wait_for(first(), timeout)

    async def nats_url(self) -> str:
        line = await self.wait_line(lambda line: "nats-server (JetStream)" in line, 5)
        found = re.search(r"nats://\S+", line)
        assert found, line
        return found[0]

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(self.proc.wait(), 90)
            except TimeoutError:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        if self._reader is not None:
            await asyncio.wait_for(self._reader, 10)

    def pids(self, target: str, node: str = "") -> list[int]:
        """The processes of `target` (a service name, or nats-server) of this cluster, from /proc."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            text = " ".join(a.decode(errors="replace") for a in argv)
            if str(self.data_dir) not in text:
                continue
            if target == "nats-server":
                hit = argv[0].endswith(b"nats-server")
            else:
                hit = f"shared.cli {target} " in text and (not node or f"--node {node} " in text)
            if hit:
                found.append(int(entry.name))
        return found


class Api:
    """The admin's API client; remade when the API server restarted (new port token) or a call fails."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.kube: Kube | None = None

    async def call(self, what: Callable[[Kube], Any], timeout: float = 120) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.kube is None:
                    self.kube = Kube(await kube_api_client(str(self.kubeconfig)), request_timeout=10)
                return await what(self.kube)
            except ApiError as exc:
                if exc.status not in (401, 403, 429, 500, 503, 504):
                    raise
                err: Exception = exc
            except Exception as exc:  # noqa: BLE001 - connection refused/reset while the API server restarts
                err = exc
            if time.monotonic() > deadline:
                raise RuntimeError(f"the API server did not answer for {timeout:.0f}s: {err}")
            await self.close()
            await asyncio.sleep(0.3)

    async def close(self) -> None:
        if self.kube is not None:
            with contextlib.suppress(Exception):
                await self.kube.api_client.close()
            self.kube = None


def admin_login(data_dir: Path) -> dict[str, Any]:
    """nats.connect options for `gpu-dra up`'s own admin identity (its NATS has no anonymous user)."""
    jwt_cb, sign_cb = Creds(admin_creds(data_dir).read_text()).callbacks()
    return {"user_jwt_cb": jwt_cb, "signature_cb": sign_cb, "inbox_prefix": "_INBOX_admin"}


def admin_creds(data_dir: Path) -> Path:
    return data_dir / "identities" / "nats" / "admin.creds"


async def stream_events(url: str, login: dict[str, Any]) -> list[dict[str, Any]]:
    nc = await nats.connect(url, **login)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe("dra.v1.claim.>", stream="DRA_EVENTS")
        out: list[dict[str, Any]] = []
        while True:
            try:
                msgs = await sub.fetch(500, timeout=2)
            except (NatsTimeout, TimeoutError):
                return out
            for msg in msgs:
                out.append(json.loads(msg.data))
                await msg.ack()
    finally:
        await nc.close()
