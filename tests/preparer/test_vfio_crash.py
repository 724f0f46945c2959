"""VFIO passthrough through a real `gpu-dra preparer` process, SIGKILLed at each bind/unbind step.

The GPU lives in a fake sysfs the simulated node makes (`services.discovery.simpci`): its bind and
unbind files are FIFOs whose writes a kernel thread in this process applies. The test holds that
thread at the N-th write, kills the preparer there (with the write applied, or dropped as if never
made), starts it again, and checks: the GPU is on exactly one driver, the claim ends prepared (the
kubelet's retry) or unprepared, and nothing is left (CDI specs, checkpoint records, driver_override).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from embedded.apiserver.testing import running_apiserver
from embedded.harness.discovery import running_discovery
from embedded.kubelet.client import register
from services.discovery import simpci
from services.preparer.gpu.pcisysfs import PciSysfs
from shared.bus import Bus
from shared.natsserver import EmbeddedNats
from tests.preparer.helpers import ApiClaims, checkpoint, claim_doc
from tests.preparer.test_crash import start_preparer, wait_for_socket

VFIO = "gpu-vfio-1"
VFIO_CONFIG = {
    "opaque": {
        "driver": "gpu.nvidia.com",
        "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "VfioDeviceConfig",
            "iommu": {"backendPolicy": "LegacyOnly", "enableAPIDevice": True},
        },
    },
    "requests": ["vm"],
    "source": "FromClaim",
}
# the writes of one prepare and its unprepare, in order
STEPS = [("unbind", "nvidia"), ("bind", "vfio-pci"), ("unbind", "vfio-pci"), ("bind", "nvidia")]


class Trap:
    """Holds the simulated kernel at the `at`-th bind/unbind write until released."""

    def __init__(self, loop: asyncio.AbstractEventLoop, at: int, apply: bool) -> None:
        self.loop, self.at, self.apply = loop, at, apply
        self.seen = 0
        self.reached = asyncio.Event()
        self.release = threading.Event()

    def __call__(self, op: simpci.PciOp) -> bool:
        index = self.seen
        self.seen += 1
        if index != self.at:
            return True
        assert (op.op, op.driver) == STEPS[index], op
        self.loop.call_soon_threadsafe(self.reached.set)
        self.release.wait(30)
        return self.apply


def cdi_specs(root: Path) -> list[str]:
    """Spec files (the CDI writer's hidden spare files are its own, kept for the next claims)."""
    return sorted(n for n in os.listdir(root / "cdi") if not n.startswith(".")) if (root / "cdi").exists() else []


async def prepare_until_it_answers(plugin: Any, claim: Any, attempts: int = 100) -> str:
    """As the kubelet does: again while the preparer has no inventory yet (it follows discovery's KV)."""
    error = ""
    for _ in range(attempts):
        error = (await plugin.prepare([claim], timeout=30))[claim.uid].error
        if "unknown" not in error:
            return error
        await asyncio.sleep(0.1)
    return error


@pytest.mark.parametrize("apply", [True, False], ids=["write-applied", "write-lost"])
async def test_sigkill_at_each_vfio_step_leaves_one_state_and_no_leaks(
    root: Path, nats_server: EmbeddedNats, apply: bool
) -> None:
    bus = await Bus.connect(nats_server.url, name="vfio-crash-test")
    await bus.provision()
    log_path = root / "preparer.log"
    reg_socket = root / "reg" / "gpu.nvidia.com-reg.sock"
    (root / "proc").mkdir()
    try:
        async with (
            running_apiserver(root / "api") as api,
            api.client() as client,
            running_discovery(bus, node="n1", simulate="h100x2", root=root / "sim") as disc,
        ):
            node_root = root / "sim" / "n1"
            sysfs = PciSysfs(node_root)
            bdf = next(g for g in disc.inventory.gpus if g.minor == 1).pci_bus_id.lower()
            bdf = bdf[4:] if len(bdf) == 16 else bdf
            kernel = simpci.serve(node_root)
            claims = ApiClaims(client)
            extra = (
                "--sys-root",
                str(node_root),
                "--proc-root",
                str(root),
                "--feature-gates",
                "PassthroughSupport=true",
            )
            for at in range(len(STEPS)):
                claim = await claims.add(claim_doc(name=f"vm-{at}", results=[("vm", VFIO)], configs=[VFIO_CONFIG]))
                trap = Trap(asyncio.get_running_loop(), at, apply)
                kernel.hook = trap
                proc = await start_preparer(root, api.kubeconfig_path, nats_server.url, log_path, *extra)
                await wait_for_socket(reg_socket, proc, log_path)
                plugin = await register(reg_socket)
                call: asyncio.Task[Any]
                if at < 2:  # killed during the prepare
                    call = asyncio.create_task(prepare_until_it_answers(plugin, claim))
                else:
                    assert await prepare_until_it_answers(plugin, claim) == "", log_path.read_text()[-3000:]
                    assert sysfs.driver_of(bdf) == "vfio-pci"
                    call = asyncio.create_task(plugin.unprepare([claim], timeout=30))
                async with asyncio.timeout(30):
                    await trap.reached.wait()
                proc.send_signal(signal.SIGKILL)
                assert await proc.wait() == -signal.SIGKILL
                reg_socket.unlink()  # the dead process's; the next one's is waited for
                trap.release.set()
                call.cancel()
                await plugin.close()
                kernel.hook = None

                # After the restart: the GPU is on exactly one driver, and the kubelet's calls finish the job.
                proc = await start_preparer(root, api.kubeconfig_path, nats_server.url, log_path, *extra)
                try:
                    await wait_for_socket(reg_socket, proc, log_path)
                    plugin = await register(reg_socket)
                    if at < 2:  # the interrupted prepare was rolled back at start: the GPU is nvidia's again
                        assert claim.uid not in checkpoint(root), checkpoint(root)
                        assert sysfs.driver_of(bdf) == "nvidia", f"step {at}: {sysfs.driver_of(bdf)!r}"
                        assert await prepare_until_it_answers(plugin, claim) == "", log_path.read_text()[-3000:]
                    assert checkpoint(root)[claim.uid]["state"] == "PrepareCompleted"
                    assert sysfs.driver_of(bdf) == "vfio-pci"
                    spec = json.loads((root / "cdi" / checkpoint(root)[claim.uid]["cdi_spec"]).read_text())
                    nodes = [n["path"] for n in spec["containerEdits"]["deviceNodes"]] + [
                        n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]
                    ]
                    group = sysfs.iommu_group(bdf)
                    assert nodes == ["/dev/vfio/vfio", f"/dev/vfio/{group}"], nodes
                    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"]
                    assert await plugin.unprepare([claim], timeout=30) == {claim.uid: ""}
                    await plugin.close()
                finally:
                    proc.send_signal(signal.SIGTERM)
                    async with asyncio.timeout(15):
                        await proc.wait()
                assert sysfs.driver_of(bdf) == "nvidia", f"step {at}"
                assert (sysfs.device_dir(bdf) / "driver_override").read_text().strip() == ""
                assert checkpoint(root) == {}, f"step {at}: records left"
                assert cdi_specs(root) == [], f"step {at}: CDI specs left"
                assert not (node_root / "dev" / "vfio" / str(sysfs.iommu_group(bdf))).exists()
                await claims.delete(claim)
    finally:
        await bus.close()
