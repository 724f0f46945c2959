"""Fixtures for the API server tests: a running server and a kubectl runner that does not block the loop."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from embedded.apiserver.testing import RunningApiServer, running_apiserver

KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "reference"


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[RunningApiServer]:
    async with running_apiserver(tmp_path) as server:
        yield server


class Kubectl:
    def __init__(self, api: RunningApiServer, cache: Path) -> None:
        self.api = api
        self.cache = cache

    async def __call__(self, *args: str, stdin: str | None = None, check: bool = True) -> tuple[int, str, str]:
        assert KUBECTL is not None
        proc = await asyncio.create_subprocess_exec(
            KUBECTL,
            "--cache-dir",
            str(self.cache),
            *args,
            env=self.api.kubectl_env(),
            stdin=asyncio.subprocess.PIPE if stdin is not None else None,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
        rc = proc.returncode or 0
        if check and rc != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({rc}):\n{err.decode()}\n{out.decode()}")
        return rc, out.decode(), err.decode()

    async def start(self, *args: str) -> asyncio.subprocess.Process:
        assert KUBECTL is not None
        return await asyncio.create_subprocess_exec(
            KUBECTL,
            "--cache-dir",
            str(self.cache),
            *args,
            env=self.api.kubectl_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )


@pytest.fixture
def kubectl(api: RunningApiServer, tmp_path: Path) -> Kubectl:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed on this machine")
    return Kubectl(api, tmp_path / "kubectl-cache")


async def wait_deleted(
    api: RunningApiServer, group: str, plural: str, namespace: str, name: str, timeout: float = 10.0
) -> None:
    """Wait (on the store's own change feed, not by polling) until the object is gone."""
    store = api.server.store
    watcher = store.watch((group, plural), None)
    try:
        if store.get((group, plural), (namespace, name)) is None:
            return

        async def deleted() -> None:
            while True:
                await watcher.wait(None)
                for change in watcher.take():
                    if change.type == "DELETED" and change.key == (namespace, name):
                        return

        await asyncio.wait_for(deleted(), timeout)
    finally:
        store.unwatch(watcher)
