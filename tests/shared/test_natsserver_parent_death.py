"""An embedded nats-server dies with the process that started it, even when that is SIGKILLed: `gpu-dra nats` runs
the same EmbeddedNats that a service starts when no NATS URL is given, and killed, it leaves no server holding its
port and store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import nats
import pytest

from tests.polling import wait_gone

REPO = Path(__file__).resolve().parents[2]


def server_of(store: Path) -> int:
    """The pid of the nats-server whose JetStream store is `store`."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if Path(argv[0].decode()).name == "nats-server" and str(store).encode() in argv:
                return int(proc.name)
    raise AssertionError(f"no nats-server runs with store {store}")


async def test_a_sigkilled_gpu_dra_nats_takes_its_server_with_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "shared.cli", "nats", "--store-dir", str(store)),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    server = 0
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        url = line.split("url=")[1].split()[0]
        server = server_of(store)
        nc = await nats.connect(url)  # while its parent lives, it serves
        await nc.close()

        proc.kill()
        await proc.wait()
        assert await asyncio.to_thread(wait_gone, server, 30), "nats-server outlived the SIGKILLed gpu-dra nats"
        host, port = url.removeprefix("nats://").split(":")
        with pytest.raises(OSError):
            await asyncio.open_connection(host, int(port))
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if server:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server, signal.SIGKILL)  # an orphan the test found must not outlive it
