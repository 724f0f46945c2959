"""A real `gpu-dra discovery` process on the simulator, over real HTTP on its --metrics-port: /metrics,
/healthz and /readyz once it has scanned, /readyz 503 naming NATS while its server is down and 200 again
after, and 404 for anything else."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.natsserver import EmbeddedNats
from shared.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError as err:  # not listening yet
        return 0, str(err)


async def wait_for(
    port: int,
    path: str,
    status: int,
    proc: asyncio.subprocess.Process,
    log: Path,
    timeout: float = 30,
    containing: str = "",
) -> str:
    """Poll another process's endpoint until `path` answers `status` with `containing` in the body (bounded)."""
    last: tuple[int, str] = (0, "")
    try:
        async with asyncio.timeout(timeout):
            while True:
                assert proc.returncode is None, log.read_text()[-3000:]
                last = await asyncio.to_thread(get, port, path)
                if last[0] == status and containing in last[1]:
                    return last[1]
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"{path} never answered {status}; last {last}; log:\n{log.read_text()[-3000:]}") from None


@pytest.fixture
async def discovery_process(
    tmp_path: Path, nats_server: EmbeddedNats
) -> AsyncIterator[tuple[int, asyncio.subprocess.Process, Path]]:
    port = free_port()
    log = tmp_path / "discovery.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_")}
    with open(log, "wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "shared.cli",
            "discovery",
            "--node",
            "n1",
            "--simulate",
            "h100x2",
            "--dev-root",
            str(tmp_path / "sim"),
            "--nats-url",
            nats_server.url,
            "--metrics-port",
            str(port),
            "--health-stall-seconds",
            "3",
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=out,
        )
    try:
        yield port, proc, log
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(15):
                await proc.wait()


async def test_discovery_serves_metrics_health_and_readiness(
    discovery_process: tuple[int, asyncio.subprocess.Process, Path], nats_server: EmbeddedNats
) -> None:
    port, proc, log = discovery_process
    assert await wait_for(port, "/readyz", 200, proc, log) == "ok\n"
    assert await wait_for(port, "/healthz", 200, proc, log) == "ok\n"
    metrics = await wait_for(port, "/metrics", 200, proc, log)
    assert "# TYPE python_info gauge" in metrics and "process_cpu_seconds_total" in metrics
    assert (await asyncio.to_thread(get, port, "/foo"))[0] == 404

    await nats_server.stop()
    text = await wait_for(port, "/readyz", 503, proc, log)
    assert text == "not ready: connected to NATS\n"
    assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 200, "a lost NATS server is not a dead process"
    await nats_server.start()
    await wait_for(port, "/readyz", 200, proc, log)
