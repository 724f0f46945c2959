"""The simulated IMEX daemon over real loopback TCP, under the supervisor: ready, reload, restart."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from services.computedomain import imexd
from services.computedomain.imex import IMEX_READY, ImexError, ImexSupervisor, render_command
from services.computedomain.imexconfig import DaemonFiles, write_peers, write_static
from shared.ports import free_port


class Watched:
    """A supervisor plus an event per readiness value, so tests await changes instead of sleeping."""

    def __init__(self, name: str, files: DaemonFiles) -> None:
        self.changes: asyncio.Queue[bool] = asyncio.Queue()
        self.sup = ImexSupervisor(
            name=name,
            command=f"{sys.executable} -m services.computedomain.imexd --config {{config}}",
            config=files.config,
            on_ready=self._on,
        )

    async def _on(self, ready: bool) -> None:
        await self.changes.put(ready)

    async def until(self, ready: bool, timeout: float = 10.0) -> None:
        async def _wait() -> None:
            while self.sup.ready != ready or not self.changes.empty():
                if await self.changes.get() == ready and self.changes.empty():
                    return

        if self.sup.ready == ready and self.changes.empty():
            return
        await asyncio.wait_for(_wait(), timeout)


def write_hosts(files: DaemonFiles, ips: dict[int, str]) -> None:
    """The simulated daemon's own hosts file names `ips` by DNS index."""
    write_peers(files, ips, peer_mode="dns", hosts_file=files.hosts)


def domain(tmp_path: Path, count: int, port: int) -> tuple[list[DaemonFiles], dict[int, str]]:
    ips = {i: f"127.0.{77 + i // 200}.{1 + i % 200}" for i in range(count)}
    files = []
    for i in range(count):
        f = DaemonFiles(tmp_path / f"n{i}")
        write_static(f, bind_ip=ips[i], server_port=port, cmd_port=port + 1, max_nodes=18, sim_hosts=f.hosts)
        files.append(f)
    return files, ips


async def test_three_daemons_connect_then_recover_from_a_kill(tmp_path):
    files, ips = domain(tmp_path, 3, free_port())
    for f in files:
        write_hosts(f, ips)
    daemons = [Watched(f"n{i}", f) for i, f in enumerate(files)]
    ready_before = IMEX_READY._value.get()  # noqa: SLF001 - the gauge is process-wide
    try:
        for d in daemons:
            await d.sup.start()
        for d in daemons:
            await d.until(True)
        assert IMEX_READY._value.get() == ready_before + 3  # noqa: SLF001
        assert await imexd.query(files[0].config) == "READY"
        victim = daemons[2].sup.pid
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        await daemons[2].until(False)
        await daemons[0].until(False)  # its peer went away
        for d in daemons:
            await d.until(True)
        assert daemons[2].sup.restarts == 1 and daemons[2].sup.pid != victim
    finally:
        for d in daemons:
            await d.sup.stop()
    assert all(d.sup.pid is None for d in daemons)
    assert IMEX_READY._value.get() == ready_before  # noqa: SLF001 - stopped daemons are not ready


async def test_sighup_adds_a_peer_from_the_hosts_file(tmp_path):
    files, ips = domain(tmp_path, 2, free_port())
    write_hosts(files[0], {0: ips[0]})  # n0 alone: ready at once
    write_hosts(files[1], ips)
    a, b = Watched("n0", files[0]), Watched("n1", files[1])
    try:
        await a.sup.start()
        await a.until(True)
        await b.sup.start()
        await b.until(True)  # b knows a and reaches it
        write_hosts(files[0], ips)
        a.sup.reload()
        await asyncio.wait_for(a.sup.wait_signalled(0), 5)
        assert a.sup.reloads == 1
        await asyncio.wait_for(a.sup.wait_reloaded(1), 5)
        await a.until(True)  # a now has b as a peer, and reaches it
        assert await imexd.query(files[0].config) == "READY"
        assert sorted(imexd.resolve_peers(imexd.load_config(files[0].config))) == [ips[1]]
    finally:
        await a.sup.stop()
        await b.sup.stop()


async def test_a_peer_that_is_down_keeps_the_daemon_not_ready(tmp_path):
    files, ips = domain(tmp_path, 2, free_port())
    write_hosts(files[0], ips)
    a = Watched("n0", files[0])
    try:
        await a.sup.start()
        proc_ok = await asyncio.wait_for(_query_until_answer(files[0].config), 10)
        assert proc_ok == "NOT_READY"
        assert not a.sup.ready
    finally:
        await a.sup.stop()


async def test_a_cancelled_supervisor_kills_its_daemon_even_when_its_report_swallows_the_cancel(tmp_path):
    """Its owner's event loop closing cancels the supervisor instead of stopping it. nats-py can swallow
    that CancelledError inside the readiness report (a KV put); the supervisor must still end, not
    restart the daemon and wait on it forever."""
    files, ips = domain(tmp_path, 1, free_port())
    write_hosts(files[0], ips)
    up, reporting_down = asyncio.Event(), asyncio.Event()

    async def on_ready(ready: bool) -> None:
        if ready:
            up.set()
        else:
            reporting_down.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass  # what a library flushing a socket may do

    sup = ImexSupervisor(
        name="n0",
        command=f"{sys.executable} -m services.computedomain.imexd --config {{config}}",
        config=files[0].config,
        on_ready=on_ready,
    )
    await sup.start()
    assert sup._task is not None
    await asyncio.wait_for(up.wait(), 10)
    assert sup.pid is not None
    os.kill(sup.pid, signal.SIGKILL)  # the supervisor reports NotReady...
    await asyncio.wait_for(reporting_down.wait(), 10)
    sup._task.cancel()  # ...and is cancelled meanwhile
    await asyncio.wait_for(asyncio.gather(sup._task, return_exceptions=True), 10)
    assert sup.restarts == 0 and sup.pid is None


async def test_a_supervisor_cancelled_while_its_daemon_runs_kills_it(tmp_path):
    files, ips = domain(tmp_path, 1, free_port())
    write_hosts(files[0], ips)
    a = Watched("n0", files[0])
    await a.sup.start()
    await a.until(True)
    pid = a.sup.pid
    assert pid is not None and a.sup._task is not None
    a.sup._task.cancel()
    await asyncio.gather(a.sup._task, return_exceptions=True)
    # killed, not just abandoned: reaped by the loop's child watcher once it exits
    await asyncio.wait_for(_gone(pid), 10)


async def _gone(pid: int) -> None:
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.05)  # a process's exit has no event a test can await


async def _query_until_answer(config: Path) -> str:
    while True:
        try:
            return await imexd.query(config)
        except OSError:
            await asyncio.sleep(0.05)  # the daemon is still binding its command port


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    cfg = tmp_path / "imexd.cfg"
    cfg.write_text("SERVER_PORT=notaport\nIMEX_NODE_CONFIG_FILE=nodes.cfg\n")
    assert imexd.main(["--config", str(cfg)]) == 2
    assert "SERVER_PORT='notaport' is not an integer" in capsys.readouterr().err
    cfg.write_text("SERVER_PORT=50000\n")
    assert imexd.main(["--config", str(cfg)]) == 2
    assert "IMEX_NODE_CONFIG_FILE is not set" in capsys.readouterr().err
    with pytest.raises(ImexError, match="cannot be parsed"):
        render_command("imexd 'unclosed", cfg)
