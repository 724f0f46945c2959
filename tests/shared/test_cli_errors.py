"""`gpu-dra` as an operator meets it: `--version` from the package metadata, a bad file or a server out of reach
as one line naming it with exit 2, and `events tail` ending quietly when its reader goes away. Real
subprocesses of `gpu-dra`."""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from shared import clierrors
from shared.bus import BusError
from shared.natsserver import EmbeddedNats
from shared.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
GPU_DRA = [sys.executable, "-m", "shared.cli"]


async def gpu_dra(*args: str, stdin: bytes = b"") -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *GPU_DRA, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_version_is_the_packages_from_pyproject() -> None:
    code, out, _ = await gpu_dra("--version")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (code, out) == (0, f"gpu-dra {version}\n")


def unreachable_kubeconfig(tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(f"""{{"apiVersion": "v1", "kind": "Config", "current-context": "c",
 "clusters": [{{"name": "c", "cluster": {{"server": "http://127.0.0.1:{free_port()}"}}}}],
 "users": [{{"name": "u", "user": {{"token": "t"}}}}],
 "contexts": [{{"name": "c", "context": {{"cluster": "c", "user": "u"}}}}]}}""")
    return path


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["explain", "--kubeconfig", "/no/such/kubeconfig", "pod", "default/x"], "/no/such/kubeconfig"),
        (["explain", "--kubeconfig", "{tmp}/dir", "pod", "default/x"], "{tmp}/dir"),
        (["explain", "--kubeconfig", "{unreachable}", "pod", "default/x"], "Cannot connect to host 127.0.0.1"),
        (["kubelet", "--node", "n", "--kubeconfig", "/no/such/kubeconfig"], "/no/such/kubeconfig"),
        (["scheduler", "--kubeconfig", "/no/such/kubeconfig"], "/no/such/kubeconfig"),
        (["controllers", "--kubeconfig", "/no/such/kubeconfig"], "/no/such/kubeconfig"),
        (["dashboard", "--kubeconfig", "/no/such/kubeconfig"], "/no/such/kubeconfig"),
        (["computedomain", "controller", "--kubeconfig", "/no/such/kubeconfig"], "/no/such/kubeconfig"),
        (["state-gate", "--nats-url", "nats://127.0.0.1:{port}", "--nats-creds", "/no/such.creds"], "/no/such.creds"),
        (["events", "tail", "--nats-url", "nats://127.0.0.1:{port}"], "cannot connect to NATS at nats://127.0.0.1:"),
        (["events", "tail", "--data-dir", "/no/such/cluster"], "/no/such/cluster/nats.json"),
        (["events", "schema", "--out", "/proc/no-such-dir"], "/proc/no-such-dir"),
        (["events", "asyncapi", "--out", "/no/such/asyncapi.json"], "/no/such/asyncapi.json"),
        (
            [
                "discovery",
                "inject-xid",
                "--node",
                "n",
                "--device",
                "gpu-0",
                "--xid",
                "79",
                "--nats-url",
                "nats://127.0.0.1:{port}",
                "--timeout",
                "1",
            ],
            "cannot connect to NATS at nats://127.0.0.1:",
        ),
        (["trace", "--file", "/no/such/spans.jsonl", "claim"], "/no/such/spans.jsonl"),
        (["nodeconfig", "explain", "n", "--config", "/no/such.yaml", "--inventory", "/no/such.json"], "/no/such"),
    ],
)
async def test_a_bad_file_or_a_server_out_of_reach_is_one_line_naming_it_exit_2(
    args: list[str], names: str, tmp_path: Path
) -> None:
    (tmp_path / "dir").mkdir()
    fill = {"tmp": str(tmp_path), "unreachable": str(unreachable_kubeconfig(tmp_path)), "port": str(free_port())}
    code, out, err = await gpu_dra(*(a.format(**fill) for a in args))
    lines = err.splitlines()
    assert (code, len(lines)) == (2, 1), f"exit {code}, {len(lines)} lines:\n{err[-3000:]}"
    assert lines[0].startswith(f"gpu-dra {args[0]}") and names.format(**fill) in lines[0], lines[0]
    assert "Traceback" not in err and not out


def test_a_long_running_service_that_cannot_reach_nats_exits_1_to_be_restarted() -> None:
    """`gpu-dra up` leaves a service that exits 2 stopped (its settings are wrong); NATS may come back. (A real
    service tries NATS for ~60 s first: the rule is checked on the error itself.)"""
    unreachable = BusError("cannot connect to NATS at nats://127.0.0.1:1 after 30 attempts")
    unreadable = BusError("cannot read NATS credentials /x")
    unreadable.__cause__ = FileNotFoundError(2, "No such file or directory", "/x")
    assert clierrors.exit_status(unreachable, ["state-gate"]) == 1
    assert clierrors.exit_status(unreachable, ["discovery", "inject-xid"]) == 2
    assert clierrors.exit_status(unreadable, ["state-gate"]) == 2
    assert clierrors.one_line(ExceptionGroup("x", [unreachable])) == str(unreachable)
    assert clierrors.one_line(ValueError("a bug")) is None


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
async def test_events_tail_into_head_ends_quietly_with_exit_0(nats_server: EmbeddedNats) -> None:
    import nats

    nc = await nats.connect(nats_server.url)
    script = f"set -o pipefail; {' '.join(GPU_DRA)} events tail --nats-url {nats_server.url} | head -2"
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", script, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )

    async def publish_until_done() -> None:  # events as a node would send them, until the pipeline ends
        while proc.returncode is None:
            await nc.publish("dra.v1.claim.ns.node-0.prepared", b'{"event": "prepared", "node": "node-0"}')
            await nc.flush()
            await asyncio.sleep(0.02)

    publisher = asyncio.create_task(publish_until_done())
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        publisher.cancel()
        await nc.close()
    assert proc.returncode == 0 and err == b"", err.decode()[-2000:]
    lines = out.decode().splitlines()
    assert len(lines) == 2 and all(re.search(r"claim-lifecycle\s+prepared", line) for line in lines), lines
