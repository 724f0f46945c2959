"""The webhook as a real process (`gpu-dra webhook --self-signed`), registered in a real embedded API server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from embedded.apiserver.testing import RunningApiServer
from services.webhook import registration
from tests.apiserver.conftest import Kubectl, api, kubectl  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunningWebhook:
    process: asyncio.subprocess.Process
    url: str
    ca_bundle: str

    def client_config(self) -> dict[str, str]:
        return {"url": self.url, "caBundle": self.ca_bundle}

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            await self.process.wait()


@contextlib.asynccontextmanager
async def running_webhook(
    cert_dir: Path, *flags: str, env: dict[str, str] | None = None
) -> AsyncIterator[RunningWebhook]:
    """`gpu-dra webhook --self-signed` on a port it picks; ready once it logs the URL it serves."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        "webhook",
        "--self-signed",
        "--cert-dir",
        str(cert_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *flags,
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(30):
            while True:
                line = (await process.stderr.readline()).decode()
                if not line:
                    raise AssertionError("the webhook exited before serving:\n" + "".join(seen))
                seen.append(line)
                found = re.search(r"url=(https://\S+)", line)
                if found:
                    break
        bundle = base64.b64encode((cert_dir / "webhook.crt").read_bytes()).decode()
        drain = asyncio.create_task(process.stderr.read())  # keep the pipe from filling
        try:
            yield RunningWebhook(process, found.group(1), bundle)
        finally:
            if process.returncode is None:
                process.terminate()
            await process.wait()
            await drain
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def register(kubectl_: Kubectl, client_config: dict[str, str]) -> None:
    """The ValidatingWebhookConfiguration `gpu-dra up` writes, applied with kubectl."""
    await kubectl_("apply", "-f", "-", stdin=json.dumps(registration.configuration(client_config)))


@pytest.fixture
async def webhook(api: RunningApiServer, kubectl: Kubectl, tmp_path: Path) -> AsyncIterator[RunningWebhook]:  # noqa: F811
    async with running_webhook(tmp_path / "webhook-certs", "--feature-gates", "PassthroughSupport=true") as hook:
        await register(kubectl, hook.client_config())
        yield hook
