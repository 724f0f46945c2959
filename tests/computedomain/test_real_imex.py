"""The real-node IMEX path on a fake driver root: the agent runs `nvidia-imex -c <config>` from the driver
root, asks `nvidia-imex-ctl -c <config> -q`, keeps its peers in /etc/hosts (or by IP), signals or
restarts the daemon on peer changes, and never leaves a daemon running, not even when it is SIGKILLed.

The stubs (tests/fakedriver.py) record every call with its pid; `nvidia-imex` runs until SIGTERM and
records the signals it catches; `nvidia-imex-ctl -q` prints `.fake/imex-status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from embedded.harness.discovery import running_discovery
from services.computedomain import orphans
from services.computedomain.channelcore import (
    ChannelClaim,
    ChannelNotReady,
    ChannelPreparer,
    channel_config,
    parse_channel_config,
)
from services.computedomain.cli import main
from services.computedomain.imex import ImexSupervisor
from services.computedomain.imexconfig import BLOCK_BEGIN, BLOCK_END, DaemonFiles, dns_name
from services.computedomain.membership import Membership, wait_for_status
from tests.computedomain.helpers import (
    announce,
    node_ip,
    prepare_when_agent_answers,
    running_nodes,
    spawn_computedomain,
)
from tests.fakedriver import FakeDriver, make_driver_root
from tests.polling import wait_gone

GB200 = "gb200x4:clique=1"
HOSTS_BEFORE = "127.0.0.1\tlocalhost\n10.9.9.9\tgpu-dra-node-abcde\n"  # what the kubelet wrote


def claim(uid: str, domain: str) -> ChannelClaim:
    return ChannelClaim(
        uid=uid, namespace="ns", name=f"claim-{uid}", config=parse_channel_config(channel_config(domain))
    )


def real(fake: FakeDriver, tmp_path: Path, **more: Any) -> dict[str, Any]:
    """Agent settings for the real daemon on the fake driver root, each node with its own hosts file."""
    # signals 0.5 s apart, not nvidia-imex's 5 s (the spacing itself: test_reload_signals_wait_for_the_handler...)
    return {
        "imex_daemon": "real",
        "driver_root": str(fake.root),
        "imex_check_interval": 0.05,
        "imex_signal_spacing": 0.5,
        **more,
    }


def hosts_files(tmp_path: Path, count: int) -> list[Path]:
    paths = [tmp_path / f"etc-hosts-{i}" for i in range(count)]
    for path in paths:
        path.write_text(HOSTS_BEFORE)
    return paths


def daemon_calls(fake: FakeDriver, pid: int | None = None) -> list[dict]:
    return [c for c in fake.calls("nvidia-imex") if pid is None or c["pid"] == pid]


async def until(predicate, timeout: float = 10.0) -> None:
    """A bounded poll for another process's effect (a stub's record), which has no event to await."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_the_real_daemon_runs_from_the_driver_root_with_its_config_and_ctl_readiness(bus, tmp_path):
    fake = make_driver_root(tmp_path / "driver")
    (hosts,) = hosts_files(tmp_path, 1)
    await announce(bus, "cd-r")
    async with running_nodes(
        bus, tmp_path, [GB200], port=50000, hosts_file=str(hosts), **real(fake, tmp_path)
    ) as nodes:
        (node,) = nodes
        edits = await node.channels.prepare(claim("c0", "cd-r"))
        assert edits.index == 0
        files = DaemonFiles(node.root / "domains" / "cd-r")
        sup = node.daemon
        await until(lambda: daemon_calls(fake) != [])  # readiness is the ctl's answer: the stub may still start
        (started,) = daemon_calls(fake)
        assert started["argv"] == ["-c", str(files.config)] and started["pid"] == sup.pid
        # started as shared.drivertools starts driver binaries: never with a library dir that holds a libc
        lib_dir = str(fake.library("x").parent)
        assert lib_dir not in started["env"].get("LD_LIBRARY_PATH", "").split(":")
        config = dict(line.split("=", 1) for line in files.config.read_text().splitlines() if "=" in line)
        assert config["IMEX_NODE_CONFIG_FILE"] == str(files.nodes) and config["SERVER_PORT"] == "50000"
        assert config["IMEX_CMD_BIND_INTERFACE_IP"] == node_ip(0)
        assert not [key for key in config if "SIM" in key], "simulator-only keys in the real daemon's config"
        assert files.nodes.read_text().splitlines() == [dns_name(i) for i in range(18)]
        assert hosts.read_text() == f"{HOSTS_BEFORE}{BLOCK_BEGIN}\n{node_ip(0)}\t{dns_name(0)}\n{BLOCK_END}\n"
        assert not files.hosts.exists(), "the real daemon resolves through the hosts file, not a file of ours"
        checks = fake.calls("nvidia-imex-ctl")
        assert checks and {tuple(c["argv"]) for c in checks} == {("-c", str(files.config), "-q")}
        assert sup.pid is not None and orphans.start_time(sup.pid) is not None and str(sup.pid) in files.pid.read_text()

        # readiness follows nvidia-imex-ctl -q, and so does the member's status
        membership = Membership(bus)
        fake.set_imex_status("NOT_READY")
        assert await wait_for_status(membership, "cd-r", "node-0", "NotReady", 10) is not None
        fake.set_imex_status("READY")
        assert await wait_for_status(membership, "cd-r", "node-0", "Ready", 10) is not None

        pid = sup.pid
        assert pid is not None
        assert await node.channels.unprepare("c0", "cd-r") is True
        assert wait_gone(pid), "the daemon outlived its domain"
        assert hosts.read_text() == HOSTS_BEFORE, "our hosts entries outlived the domain"
        assert not files.directory.exists()
        assert [c.get("signal") for c in daemon_calls(fake, pid)] == [None], "no reload signal without a peer"


async def test_a_new_peer_is_written_to_the_hosts_block_and_the_daemon_is_signalled(bus, tmp_path):
    fake = make_driver_root(tmp_path / "driver")
    hosts = hosts_files(tmp_path, 2)
    await announce(bus, "cd-p")
    async with running_nodes(
        bus, tmp_path, [GB200] * 2, per_node=[{"hosts_file": str(p)} for p in hosts], **real(fake, tmp_path)
    ) as nodes:  # each agent its own /etc/hosts, as each pod has
        await nodes[0].channels.prepare(claim("a", "cd-p"))
        first = nodes[0].daemon
        await nodes[1].channels.prepare(claim("b", "cd-p"))
        entries = f"{node_ip(0)}\t{dns_name(0)}\n{node_ip(1)}\t{dns_name(1)}\n"
        for path in hosts:
            assert path.read_text() == f"{HOSTS_BEFORE}{BLOCK_BEGIN}\n{entries}{BLOCK_END}\n"
        await asyncio.wait_for(first.wait_signalled(0), 10)
        await until(lambda: any(c.get("signal") == "SIGUSR1" for c in daemon_calls(fake, first.pid)))
        assert first.restarts == 0 and first.replaced == 0, "a DNS peer change needs no restart"
        # the peer leaves: its entry goes, the remaining daemon is told
        signalled = first.reloads
        assert await nodes[1].channels.unprepare("b", "cd-p") is True
        await asyncio.wait_for(first.wait_signalled(signalled), 10)
        assert hosts[0].read_text() == f"{HOSTS_BEFORE}{BLOCK_BEGIN}\n{node_ip(0)}\t{dns_name(0)}\n{BLOCK_END}\n"
        assert hosts[1].read_text() == HOSTS_BEFORE


async def test_peers_by_ip_rewrite_the_nodes_file_and_restart_the_daemon(bus, tmp_path):
    fake = make_driver_root(tmp_path / "driver")
    (hosts,) = hosts_files(tmp_path, 1)
    await announce(bus, "cd-ip")
    async with running_nodes(
        bus, tmp_path, [GB200] * 2, hosts_file=str(hosts), **real(fake, tmp_path, imex_peer_mode="ip")
    ) as nodes:
        await nodes[0].channels.prepare(claim("a", "cd-ip"))
        first = nodes[0].daemon
        files = DaemonFiles(nodes[0].root / "domains" / "cd-ip")
        assert files.nodes.read_text() == f"{node_ip(0)}\n"
        old_pid = first.pid
        assert old_pid is not None
        await nodes[1].channels.prepare(claim("b", "cd-ip"))
        assert files.nodes.read_text() == f"{node_ip(0)}\n{node_ip(1)}\n"  # index order, on every node
        mine = lambda: [c for c in daemon_calls(fake) if c["argv"] == ["-c", str(files.config)]]  # noqa: E731
        # the replacement daemon has started and recorded itself (the first one may have been replaced before
        # its stub got as far as recording its call, so count by pid, not by calls)
        await until(lambda: first.pid not in (None, old_pid) and any(c["pid"] == first.pid for c in mine()), 20)
        assert wait_gone(old_pid), "the daemon with the old nodes file is still running"
        assert first.replaced == 1 and first.restarts == 0 and first.pid == mine()[-1]["pid"] != old_pid
        assert hosts.read_text() == HOSTS_BEFORE, "peers by IP touch no hosts file"
        assert "SIM" not in files.config.read_text()


async def test_reload_signals_wait_for_the_handler_and_are_spaced_as_nvidia_imex_needs(tmp_path):
    """nvidia-imex acts on one SIGUSR1 per 5 s: three changes in a row become one signal now and one
    when the window ends, and none is sent before the daemon catches the signal (it would end it)."""
    fake = make_driver_root(tmp_path / "driver")
    files = DaemonFiles(tmp_path / "d")
    files.directory.mkdir()
    ready = asyncio.Event()

    async def on_ready(value: bool) -> None:
        if value:
            ready.set()

    sup = ImexSupervisor(
        name="n0",
        command=f"{fake.root}/usr/bin/nvidia-imex -c {{config}}",
        config=files.config,
        on_ready=on_ready,
        signal_spacing=0.5,
        check_interval=0.05,
        check_command=f"{fake.root}/usr/bin/nvidia-imex-ctl -c {{config}} -q",
        pid_file=files.pid,
    )
    await sup.start()
    try:
        await until(lambda: sup.pid is not None)
        sup.reload()  # at once, likely before the stub has its handler
        await asyncio.wait_for(ready.wait(), 10)
        await asyncio.wait_for(sup.wait_signalled(0), 10)
        sup.reload()
        sup.reload()
        await asyncio.wait_for(sup.wait_signalled(1), 10)
        pid = sup.pid
        assert pid is not None
        await until(lambda: len([c for c in daemon_calls(fake, pid) if c.get("signal")]) == 2)
        got = [c for c in daemon_calls(fake, pid) if c.get("signal")]
        assert [c["signal"] for c in got] == ["SIGUSR1", "SIGUSR1"]
        assert got[1]["time"] - got[0]["time"] >= 0.45
        assert sup.restarts == 0 and sup.reloads == 2
    finally:
        await sup.stop()
    assert wait_gone(pid) and not files.pid.exists()


async def test_an_agent_ends_the_daemons_a_previous_agent_left_and_their_files(bus, tmp_path):
    fake = make_driver_root(tmp_path / "driver")
    (hosts,) = hosts_files(tmp_path, 1)
    hosts.write_text(f"{HOSTS_BEFORE}{BLOCK_BEGIN}\n10.1.1.1\t{dns_name(3)}\n{BLOCK_END}\n")
    left = DaemonFiles(tmp_path / "agents" / "node-0" / "domains" / "cd-gone")
    left.directory.mkdir(parents=True)
    orphan = await asyncio.create_subprocess_exec(
        f"{fake.root}/usr/bin/nvidia-imex", "-c", str(left.config), start_new_session=True
    )
    bystander = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(60)", start_new_session=True
    )
    try:
        await until(lambda: daemon_calls(fake, orphan.pid) != [])  # its SIGTERM handler is installed
        orphans.record(left.pid, orphan.pid, "nvidia-imex")
        reused = DaemonFiles(left.directory.parent / "cd-older")
        reused.directory.mkdir()
        reused.pid.write_text(f'{{"pid": {bystander.pid}, "start_time": 1, "command": "nvidia-imex"}}')
        async with running_nodes(bus, tmp_path, [GB200], hosts_file=str(hosts), **real(fake, tmp_path)):
            assert await asyncio.wait_for(orphan.wait(), 10) == 0, "the orphaned daemon was not ended by SIGTERM"
            assert bystander.returncode is None, "a process that reused a recorded pid was signalled"
            assert not left.directory.exists() and not reused.directory.exists()
            assert hosts.read_text() == HOSTS_BEFORE
    finally:
        for proc in (orphan, bystander):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_a_missing_nvidia_imex_is_a_clear_retryable_error_for_fabric_nodes_only(bus, tmp_path):
    fake = make_driver_root(tmp_path / "driver", binaries=("nvidia-smi",))
    (hosts,) = hosts_files(tmp_path, 1)
    await announce(bus, "cd-m")
    await announce(bus, "cd-plain")
    async with running_nodes(
        bus, tmp_path, [GB200, "h100x2"], hosts_file=str(hosts), ready_timeout=2, **real(fake, tmp_path)
    ) as nodes:
        with pytest.raises(ChannelNotReady, match=rf"no nvidia-imex or nvidia-imex-ctl under driver root {fake.root}"):
            await nodes[0].channels.prepare(claim("m", "cd-m"))
        assert nodes[0].agent.domain is None and await Membership(bus).members("cd-m") == {}
        plain = await nodes[1].channels.prepare(claim("p", "cd-plain"))  # no fabric, no daemon needed
        assert plain.device_nodes == []


async def test_a_sigkilled_agent_leaves_no_daemon_and_its_successor_resumes_with_a_fresh_one(
    bus, nats_server, tmp_path
):
    fake = make_driver_root(tmp_path / "driver")
    (hosts,) = hosts_files(tmp_path, 1)
    state = tmp_path / "agent"
    await announce(bus, "cd-k")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_")}
    env["GPU_DRA_NATS_URL"] = nats_server.url
    args = [
        "agent",
        "--node",
        "n0",
        "--ip-address",
        "127.0.88.1",
        "--state-dir",
        str(state),
        "--driver-root",
        str(fake.root),
        "--hosts-file",
        str(hosts),
        "--imex-check-interval",
        "0.05",
    ]
    async with running_discovery(bus, "n0", simulate="gb200x4:clique=3", root=tmp_path / "sim"):
        channels = ChannelPreparer(
            bus, node="n0", dev_root=str(tmp_path / "sim" / "n0"), ready_timeout=20, simulated=True
        )
        first = await spawn_computedomain(*args, env=env)
        second = None
        try:
            await prepare_when_agent_answers(channels, claim("k", "cd-k"))
            await until(lambda: daemon_calls(fake) != [])
            (started,) = daemon_calls(fake)
            daemon = started["pid"]
            assert orphans.start_time(daemon) is not None
            first.send_signal(signal.SIGKILL)
            await first.wait()
            assert wait_gone(daemon), "the daemon outlived its SIGKILLed agent"
            second = await spawn_computedomain(*args, env=env)
            await until(lambda: len(daemon_calls(fake)) == 2, timeout=20)  # it resumes the domain
            fresh = daemon_calls(fake)[-1]["pid"]
            assert await wait_for_status(Membership(bus), "cd-k", "n0", "Ready", 20) is not None
            assert fresh != daemon and orphans.start_time(fresh) is not None
            second.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(second.wait(), 20) == 0
            assert wait_gone(fresh), "the daemon outlived its stopped agent"
        finally:
            for proc in (first, second):
                if proc is not None and proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            for call in daemon_calls(fake):  # a failed run must not leave its daemons behind either
                with contextlib.suppress(ProcessLookupError):
                    os.kill(call["pid"], signal.SIGKILL)


def test_bad_real_daemon_settings_are_refused_at_start(capsys, tmp_path):
    assert main(["agent", "--node", "n1", "--ip-address", "10.0.0.1", "--hosts-file", "etc/hosts"]) == 2
    assert "--hosts-file must be an absolute path" in capsys.readouterr().err
    assert main(["agent", "--node", "n1", "--ip-address", "10.0.0.1", "--driver-root", "driver"]) == 2
    assert "--driver-root must be an absolute path, got 'driver'" in capsys.readouterr().err
    assert main(["agent", "--node", "n1", "--ip-address", "10.0.0.1", "--imex-reload-signal", "SIGNOPE"]) == 2
    assert "unknown signal 'SIGNOPE'" in capsys.readouterr().err
    assert main(["agent", "--node", "n1", "--ip-address", "10.0.0.1", "--imex-peer-mode", "names"]) == 2
    assert "expected one of dns, ip" in capsys.readouterr().err
