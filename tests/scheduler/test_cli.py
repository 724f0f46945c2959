"""`gpu-dra scheduler` as its own process: it binds a pod and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from shared.kube.resources import RESOURCECLAIMS
from tests.polling import eventually
from tests.scheduler.loophelpers import cluster
from tests.scheduler.test_loop import named_claim

ROOT = Path(__file__).resolve().parents[2]


async def test_scheduler_command_binds_and_stops_on_sigterm(tmp_path, h100_inv):
    async with cluster(tmp_path, h100_inv, nodes=1, start=False) as c:
        await c.kube.create(RESOURCECLAIMS, "default", named_claim("mine"))
        await c.pod("p", [{"name": "gpu", "resourceClaimName": "mine"}])
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "shared.cli",
            "scheduler",
            "--kubeconfig",
            str(c.api.kubeconfig_path),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:

            async def bound() -> object:
                return (await c.get_pod("p"))["spec"].get("nodeName")

            assert await eventually(bound, timeout=20, what="pod bound by the scheduler process") == "node-0"
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, out.decode()
        assert b"pod bound" in out


async def test_scheduler_command_rejects_unknown_flags():
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        "scheduler",
        "--no-such-flag",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert b"no-such-flag" in err
