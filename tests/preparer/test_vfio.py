"""VFIO passthrough prepares through the preparer's real sockets, discovery in-process on simulated H100s whose
fake sysfs (`services.discovery.simpci`) a kernel thread serves: `modprobe vfio_pci` (a stub) when the
vfio-pci driver is absent, the wait while a process holds `/dev/nvidia<minor>` (a fake /proc), the iommufd
nodes of `PreferIommuFD`, and a GPU never given out both to nvidia and for passthrough.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from embedded.harness.discovery import RunningDiscovery
from embedded.kubelet.client import Claim
from services.discovery import simpci
from services.preparer.gpu.pcisysfs import PciSysfs, normal_bdf
from shared.bus import Bus
from tests.polling import eventually
from tests.preparer.helpers import DRIVER, MemoryClaims, Node, checkpoint, claim_doc, running_node


def vfio_config(requests: list[str], **iommu: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig"}
    if iommu:
        params["iommu"] = iommu
    return {"source": "FromClaim", "requests": requests, "opaque": {"driver": DRIVER, "parameters": params}}


@contextlib.asynccontextmanager
async def vfio_node(claims: MemoryClaims, root: Path, bus: Bus, **overrides: Any) -> AsyncIterator[Node]:
    """The preparer with the simulated node's sysfs and a fake /proc (`root/proc`, empty: no GPU in use)."""
    node_root = root / "sim" / "n1"
    simpci.serve(node_root)
    (root / "proc").mkdir(exist_ok=True)
    async with running_node(
        claims,
        root,
        bus=bus,
        sys_root=str(node_root),
        proc_root=str(root),
        feature_gates="PassthroughSupport=true",
        **overrides,
    ) as node:
        yield node


def bdf_of(discovery: RunningDiscovery, minor: int) -> str:
    return normal_bdf(next(g for g in discovery.inventory.gpus if g.minor == minor).pci_bus_id)


def device_nodes(node: Node, uid: str) -> list[str]:
    """The claim spec's device nodes: spec-level first, then the devices'."""
    spec = json.loads((node.cdi_dir / f"k8s.gpu.nvidia.com-claim_{uid}.json").read_text())
    return [n["path"] for n in spec.get("containerEdits", {}).get("deviceNodes") or []] + [
        n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes") or []
    ]


async def prepare(node: Node, claims: MemoryClaims, doc: dict[str, Any]) -> tuple[Claim, str]:
    claim = claims.add(doc)
    return claim, (await node.plugin.prepare([claim], timeout=30))[claim.uid].error


async def test_modprobe_runs_when_vfio_pci_is_absent_and_a_failed_load_is_named(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    node_root = root / "sim" / "n1"
    drivers, modules = node_root / "sys/bus/pci/drivers", node_root / "sys/module"
    unloaded = root / "vfio-pci-unloaded"  # the driver's dir while the module is out (its FIFOs stay served)
    calls = root / "modprobe-calls"
    stub = root / "modprobe"
    stub.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        f'[ -e {root}/modprobe-fails ] && {{ echo "FATAL: Module vfio_pci not found." >&2; exit 1; }}\n'
        f"mv {unloaded} {drivers}/vfio-pci && mkdir -p {modules}/vfio_pci\n"
    )
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    sysfs = PciSysfs(node_root)
    async with vfio_node(claims, root, bus, modprobe=str(stub)) as node:
        os.rename(drivers / "vfio-pci", unloaded)
        (modules / "vfio_pci").rmdir()
        (root / "modprobe-fails").touch()
        claim, error = await prepare(node, claims, claim_doc(name="vm-0", results=[("vm", "gpu-vfio-2")]))
        assert (
            f"{stub} vfio_pci did not make the vfio-pci driver appear (exit 1: FATAL: Module vfio_pci not "
            "found.)" in error
        ), error
        assert sysfs.driver_of(bdf_of(discovery, 2)) == "nvidia"  # rolled back to where it was
        assert claim.uid not in checkpoint(root)

        (root / "modprobe-fails").unlink()
        claim, error = await prepare(node, claims, claim_doc(name="vm-1", results=[("vm", "gpu-vfio-2")]))
        assert error == ""
        assert calls.read_text() == "vfio_pci\nvfio_pci\n"
        assert sysfs.driver_of(bdf_of(discovery, 2)) == "vfio-pci" and sysfs.driver_present("vfio-pci")
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert sysfs.driver_of(bdf_of(discovery, 2)) == "nvidia"


async def test_prepare_waits_while_a_process_holds_the_gpu_then_moves_it(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    holder = root / "proc" / "4242" / "fd"
    holder.mkdir(parents=True)
    (holder / "7").symlink_to("/dev/nvidia3")  # what a CUDA process holding GPU 3 shows in /proc/<pid>/fd
    sysfs = PciSysfs(root / "sim" / "n1")
    bdf = bdf_of(discovery, 3)
    async with vfio_node(claims, root, bus, vfio_free_timeout=30.0) as node:
        claim = claims.add(claim_doc(name="vm", results=[("vm", "gpu-vfio-3")]))
        call = asyncio.create_task(node.plugin.prepare([claim], timeout=40))
        # the record naming the GPU is on disk before the first sysfs write: the prepare is at the wait now
        await eventually(lambda: claim.uid in checkpoint(root), "the prepare started", timeout=10.0)
        done, _ = await asyncio.wait({call}, timeout=2.5)  # the GPU is looked at every 1 s: it stays held
        assert not done and sysfs.driver_of(bdf) == "nvidia"
        (holder / "7").unlink()  # the process closed it
        assert (await call)[claim.uid].error == ""
        assert sysfs.driver_of(bdf) == "vfio-pci"
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}


async def test_prepare_fails_clearly_when_the_gpu_stays_in_use(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    node_root = root / "sim" / "n1"
    holder = root / "proc" / "4242" / "fd"
    holder.mkdir(parents=True)
    (holder / "7").symlink_to(node_root / "dev" / "nvidia3")  # the host path of the node's device node
    sysfs = PciSysfs(node_root)
    async with vfio_node(claims, root, bus, vfio_free_timeout=1.5) as node:
        claim, error = await prepare(node, claims, claim_doc(name="vm", results=[("vm", "gpu-vfio-3")]))
        assert f"GPU {bdf_of(discovery, 3)} (/dev/nvidia3) is still open by process(es) [4242] after 1.5s" in error, (
            error
        )
        assert sysfs.driver_of(bdf_of(discovery, 3)) == "nvidia"
        assert claim.uid not in checkpoint(root)


async def test_prefer_iommufd_yields_the_iommufd_nodes_where_the_node_has_dev_iommu(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    sysfs = PciSysfs(root / "sim" / "n1")
    group = sysfs.iommu_group(bdf_of(discovery, 4))
    async with vfio_node(claims, root, bus) as node:
        config = vfio_config(["vm"], backendPolicy="PreferIommuFD", enableAPIDevice=True)
        legacy, error = await prepare(
            node, claims, claim_doc(name="no-iommufd", results=[("vm", "gpu-vfio-4")], configs=[config])
        )
        assert error == ""
        assert device_nodes(node, legacy.uid) == ["/dev/vfio/vfio", f"/dev/vfio/{group}"]  # no /dev/iommu here
        assert await node.plugin.unprepare([legacy]) == {legacy.uid: ""}

        (root / "sim" / "n1" / "dev" / "iommu").touch()  # a kernel with iommufd
        claim, error = await prepare(
            node, claims, claim_doc(name="iommufd", results=[("vm", "gpu-vfio-4")], configs=[config])
        )
        assert error == ""
        cdev = sysfs.iommufd_node(bdf_of(discovery, 4))
        assert cdev.startswith("vfio")
        assert device_nodes(node, claim.uid) == ["/dev/iommu", f"/dev/vfio/devices/{cdev}"]
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}

        no_api = vfio_config(["vm"], backendPolicy="PreferIommuFD")
        claim, error = await prepare(
            node, claims, claim_doc(name="iommufd-no-api", results=[("vm", "gpu-vfio-4")], configs=[no_api])
        )
        assert error == ""
        assert device_nodes(node, claim.uid) == [f"/dev/vfio/devices/{cdev}"]
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}


async def test_a_gpu_is_refused_for_passthrough_while_nvidia_serves_it_and_the_other_way(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    sysfs = PciSysfs(root / "sim" / "n1")
    bdf = bdf_of(discovery, 5)
    async with vfio_node(claims, root, bus) as node:
        whole, error = await prepare(node, claims, claim_doc(name="cuda", results=[("gpu", "gpu-5")]))
        assert error == ""
        vm, error = await prepare(node, claims, claim_doc(name="vm", results=[("vm", "gpu-vfio-5")]))
        assert "held by another claim on this node as gpu-5" in error and "not both" in error, error
        assert sysfs.driver_of(bdf) == "nvidia" and vm.uid not in checkpoint(root)
        assert await node.plugin.unprepare([whole]) == {whole.uid: ""}

        vm, error = await prepare(node, claims, claim_doc(name="vm-2", results=[("vm", "gpu-vfio-5")]))
        assert error == "" and sysfs.driver_of(bdf) == "vfio-pci"
        for name, device in (("cuda-2", "gpu-5"), ("mig", "gpu-5-mig-1g10gb-19-0")):
            other, error = await prepare(node, claims, claim_doc(name=name, results=[("gpu", device)]))
            assert "held by another claim on this node as gpu-vfio-5" in error, (device, error)
            assert other.uid not in checkpoint(root)
        assert sysfs.driver_of(bdf) == "vfio-pci"
        assert await node.plugin.unprepare([vm]) == {vm.uid: ""}

        mixed, error = await prepare(
            node, claims, claim_doc(name="mixed", results=[("vm", "gpu-vfio-6"), ("gpu", "gpu-7")])
        )
        assert "holds passthrough GPUs only" in error, error
        assert sysfs.driver_of(bdf_of(discovery, 6)) == "nvidia" and mixed.uid not in checkpoint(root)
