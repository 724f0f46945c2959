"""Running the embedded API server from tests and tools.

    async with running_apiserver(tmp_path) as api:      # in-process, same event loop
        async with api.client() as client:             # kubernetes_asyncio ApiClient
            await CoreV1Api(client).list_node()
        subprocess.run(["kubectl", "get", "nodes"], env={**os.environ, "KUBECONFIG": str(api.kubeconfig_path)})

    with running_apiserver_thread(tmp_path) as api:     # its own loop on a thread (sync tests)
        ...

`api.url`, `api.token`, `api.kubeconfig_path`, and `api.server` (the ApiServer, for its store).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from embedded.apiserver.server import ApiServer


class RunningApiServer:
    def __init__(self, server: ApiServer, kubeconfig_path: Path) -> None:
        self.server = server
        self.kubeconfig_path = kubeconfig_path

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def token(self) -> str:
        return self.server.token

    def kubectl_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        import os

        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig_path)
        return env

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[k8s_client.ApiClient]:
        """A kubernetes_asyncio ApiClient loaded from the written kubeconfig, closed on exit."""
        configuration = k8s_client.Configuration()
        await k8s_config.load_kube_config(config_file=str(self.kubeconfig_path), client_configuration=configuration)
        async with k8s_client.ApiClient(configuration) as api_client:
            yield api_client


@contextlib.asynccontextmanager
async def running_apiserver(
    tmp_path: Path, data_dir: Path | None = None, **options: Any
) -> AsyncIterator[RunningApiServer]:
    """An API server on a free 127.0.0.1 port for the duration of the block.

    `options` go to ApiServer (token, port, history_size, bookmark_interval)."""
    server = ApiServer(data_dir=data_dir, **options)
    await server.start()
    kubeconfig = server.write_kubeconfig(Path(tmp_path) / "kubeconfig")
    try:
        yield RunningApiServer(server, kubeconfig)
    finally:
        await server.stop()


@contextlib.contextmanager
def running_apiserver_thread(
    tmp_path: Path, data_dir: Path | None = None, **options: Any
) -> Iterator[RunningApiServer]:
    """The same server on its own event loop in a thread, for synchronous callers."""
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        holder["loop"], holder["stop"] = asyncio.get_running_loop(), stop
        try:
            async with running_apiserver(tmp_path, data_dir, **options) as api:
                holder["api"] = api
                ready.set()
                await stop.wait()
        except BaseException as exc:
            holder["error"] = exc
            ready.set()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="apiserver", daemon=True)
    thread.start()
    ready.wait(30)
    if "error" in holder:
        raise RuntimeError(f"the embedded API server did not start: {holder['error']}")
    if "api" not in holder:
        raise RuntimeError("the embedded API server did not start within 30 s")
    try:
        yield holder["api"]
    finally:
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        thread.join(30)
