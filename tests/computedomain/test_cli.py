"""`gpu-dra computedomain`: settings errors, and the real processes (two controllers, one agent)."""

from __future__ import annotations

import asyncio
import os
import signal

from kubernetes_asyncio import client

from embedded.apiserver.testing import running_apiserver
from embedded.harness.discovery import running_discovery
from services.computedomain import crd
from services.computedomain.channelcore import (
    ChannelClaim,
    ChannelPreparer,
    channel_config,
    parse_channel_config,
)
from services.computedomain.cli import main
from shared.bus import Bus
from shared.ports import free_port
from tests.computedomain.helpers import (
    install_crds,
    prepare_when_agent_answers,
    spawn_computedomain,
    wait_for_object,
)


def test_help_and_bad_settings(capsys, monkeypatch):
    assert main(["--help"]) == 0
    assert "controller" in capsys.readouterr().out
    assert main(["agent", "--ip-address", "not-an-ip", "--node", "n1"]) == 2
    assert "--ip-address 'not-an-ip' is not an IP address" in capsys.readouterr().err
    assert main(["controller", "--lease-duration", "5", "--renew-deadline", "10"]) == 2
    assert "must be below --lease-duration" in capsys.readouterr().err
    monkeypatch.setenv("GPU_DRA_IMEX_PORT", "1")
    assert main(["agent"]) == 2
    assert "unknown setting(s) GPU_DRA_IMEX_PORT" in capsys.readouterr().err
    monkeypatch.delenv("GPU_DRA_IMEX_PORT")
    assert main(["sideways"]) == 2


async def test_processes_domain_ready_then_leader_killed_and_standby_continues(nats_server, tmp_path):
    bus = await Bus.connect(nats_server.url, name="test")
    await bus.provision()
    procs: list[asyncio.subprocess.Process] = []
    async with running_apiserver(tmp_path) as api, api.client() as kube:
        await install_crds(kube)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_")}
        env["GPU_DRA_NATS_URL"] = nats_server.url
        ctl = [
            "controller",
            "--kubeconfig",
            str(api.kubeconfig_path),
            "--lease-duration",
            "2",
            "--renew-deadline",
            "1.5",
            "--retry-period",
            "0.2",
        ]
        port = free_port()
        try:
            procs.append(await spawn_computedomain(*ctl, "--identity", "one", env=env))
            procs.append(await spawn_computedomain(*ctl, "--identity", "two", env=env))
            custom = client.CustomObjectsApi(kube)
            async with running_discovery(bus, "n0", simulate="gb200x4:clique=3", root=tmp_path / "sim"):
                procs.append(
                    await spawn_computedomain(
                        "agent",
                        "--node",
                        "n0",
                        "--ip-address",
                        "127.0.88.1",
                        "--state-dir",
                        str(tmp_path / "agent"),
                        "--imex-server-port",
                        str(port),
                        "--imex-cmd-port",
                        str(port + 1),
                        "--imex-daemon",
                        "simulated",
                        env=env,
                    )
                )
                created = await custom.create_namespaced_custom_object(
                    crd.GROUP,
                    crd.VERSION,
                    "ns",
                    crd.PLURAL,
                    {
                        "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
                        "kind": crd.KIND,
                        "metadata": {"name": "p"},
                        "spec": {"channel": {"resourceClaimTemplate": {"name": "p-channel"}}},
                    },
                )
                uid = created["metadata"]["uid"]
                lease = await _wait_lease(kube)
                leader = procs[0] if lease.startswith("one-") else procs[1]
                channels = ChannelPreparer(
                    bus, node="n0", dev_root=str(tmp_path / "sim" / "n0"), ready_timeout=20, simulated=True
                )
                cfg = parse_channel_config(channel_config(uid))
                edits = await prepare_when_agent_answers(channels, ChannelClaim("c0", "ns", "c0", cfg))
                assert edits.device_nodes[0].path == "/dev/nvidia-caps-imex-channels/channel0"
                await wait_for_object(
                    custom,
                    crd.GROUP,
                    crd.VERSION,
                    "ns",
                    crd.PLURAL,
                    "p",
                    lambda o: (
                        o
                        and (o.get("status") or {}).get("status") == "Ready"
                        and len(o["status"].get("nodes", [])) == 1
                    ),
                    timeout=20,
                )
                leader.send_signal(signal.SIGKILL)
                await leader.wait()
                # the standby takes over and deletion still cleans up everything
                await custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, "ns", crd.PLURAL, "p")
                await wait_for_object(
                    custom, crd.GROUP, crd.VERSION, "ns", crd.PLURAL, "p", lambda o: o is None, timeout=20
                )
                assert not (tmp_path / "agent" / "domains" / uid).exists()
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    await asyncio.wait_for(proc.wait(), 15)
                except TimeoutError:
                    proc.kill()
            await bus.close()
    assert [p.returncode for p in procs if p is not leader] == [0, 0]


async def _wait_lease(kube) -> str:
    coord = client.CoordinationV1Api(kube)
    for _ in range(200):
        try:
            lease = await coord.read_namespaced_lease("gpu-dra-computedomain-controller", "default")
            if lease.spec.holder_identity:
                return lease.spec.holder_identity
        except client.exceptions.ApiException:
            pass
        await asyncio.sleep(0.05)  # the processes are still starting; nothing to watch yet
    raise AssertionError("no controller took the Lease")
