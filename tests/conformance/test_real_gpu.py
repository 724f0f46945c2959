"""Real-hardware conformance: discovery, `cdi generate` and prepare/unprepare against the host's real driver.

Marker `gpu`; skipped unless `GPU_DRA_TEST_REAL_NVML=1` (a GPU node, or NVIDIA's mock NVML library on the
library path). Settings:
  GPU_DRA_TEST_DRIVER_ROOT   the driver root (default `/`); with the mock NVML, a directory whose `lib64`
                             (or `usr/lib64`) holds its `libnvidia-ml.so.<version>` and `libnvidia-ml.so.1`
  GPU_DRA_TEST_DEV_ROOT      where `/dev/nvidia*` are (default: the driver root)
Tests that need what only a real GPU node has (a MIG-enabled GPU, the MPS control daemon) skip, naming it,
when the node lacks it. Everything runs through the product's own paths: real NVML through discovery's NVML
layer, the preparer on its real sockets with the kubelet emulator's gRPC client, a real nats-server.
Run on a GPU machine: `GPU_DRA_TEST_REAL_NVML=1 python -m pytest -m gpu tests/conformance`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from embedded.harness.discovery import RunningDiscovery
from services.discovery.config import DiscoveryConfig
from services.discovery.service import Scanner, open_nvml
from shared.bus import Bus
from shared.driverroot import DriverRoot
from tests.preparer.cdischema import spec_errors
from tests.preparer.helpers import MemoryClaims, claim_doc, cleanup, gpu_config, running_node, short_root

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        os.environ.get("GPU_DRA_TEST_REAL_NVML") != "1",
        reason="real-hardware conformance: set GPU_DRA_TEST_REAL_NVML=1 on a GPU node",
    ),
]

DRIVER_ROOT = os.environ.get("GPU_DRA_TEST_DRIVER_ROOT", "/")
DEV_ROOT = os.environ.get("GPU_DRA_TEST_DEV_ROOT", "")
NODE = "conformance-node"


def _discovery_config() -> DiscoveryConfig:
    return DiscoveryConfig(node=NODE, driver_root=DRIVER_ROOT, dev_root=DEV_ROOT or DRIVER_ROOT).resolved()


def _validate_cdi(spec: dict) -> None:
    assert spec_errors(spec) == []


@pytest.fixture
def root() -> Iterator[Path]:
    path = short_root()
    yield path
    cleanup(path)


@pytest.fixture
async def real_discovery(bus: Bus) -> AsyncIterator[RunningDiscovery]:
    import asyncio
    import contextlib

    from services.discovery.service import DiscoveryService

    cfg = _discovery_config()
    nvml = open_nvml(cfg)
    await nvml.start()
    service = DiscoveryService(cfg, nvml, bus)
    stopping = asyncio.Event()
    task = asyncio.create_task(service.run(stopping))
    try:
        async with asyncio.timeout(60):
            await service.ready.wait()
        yield RunningDiscovery(service)
    finally:
        stopping.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await nvml.close()


async def test_discovery_reads_the_real_gpus_and_the_driver_version() -> None:
    cfg = _discovery_config()
    nvml = open_nvml(cfg)
    await nvml.start()
    try:
        inventory = await Scanner(cfg, nvml).scan()
    finally:
        await nvml.close()
    assert inventory.gpus, "NVML reports no GPU on this node"
    for gpu in inventory.gpus:
        assert gpu.uuid.startswith("GPU-"), gpu.uuid
        assert gpu.memory_bytes > 0 and gpu.product_name
    version = DriverRoot.of(DRIVER_ROOT, "", DEV_ROOT).driver_version()
    assert inventory.driver_version.split(".")[0] == version.split(".")[0], (inventory.driver_version, version)


def test_cdi_generate_names_every_gpu_and_the_driver_userspace() -> None:
    args = [sys.executable, "-m", "shared.cli", "cdi", "generate", "--driver-root", DRIVER_ROOT]
    if DEV_ROOT:
        args += ["--dev-root", DEV_ROOT]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    spec = json.loads(out.stdout)
    _validate_cdi(spec)
    assert spec["kind"] == "k8s.gpu.nvidia.com/device"
    names = {d["name"] for d in spec["devices"]}
    version = DriverRoot.of(DRIVER_ROOT, "", DEV_ROOT).driver_version()
    mounts = [m["containerPath"] for m in spec["containerEdits"].get("mounts", [])]
    assert any(p.endswith(f"libnvidia-ml.so.{version}") for p in mounts), mounts
    assert "0" in names and any(n.startswith("GPU-") for n in names), names
    again = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert again.stdout == out.stdout  # stable across runs


async def _prepare_unprepare(root: Path, bus: Bus, doc: dict) -> dict:
    claims = MemoryClaims()
    claim = claims.add(doc)
    async with running_node(claims, root, bus=bus, node=NODE, driver_root=DRIVER_ROOT, dev_root=DEV_ROOT or "") as node:
        result = (await node.plugin.prepare([claim]))[claim.uid]
        assert result.error == "", result.error
        [spec_file] = node.cdi_files()
        spec = json.loads((node.cdi_dir / spec_file).read_text())
        _validate_cdi(spec)
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert node.cdi_files() == []
        return spec


async def test_full_gpu_claim_prepares_with_the_driver_userspace(
    root: Path, bus: Bus, real_discovery: RunningDiscovery
) -> None:
    gpu = real_discovery.inventory.gpus[0]
    spec = await _prepare_unprepare(root, bus, claim_doc(name="full", node=NODE, results=[("gpu", gpu.name)]))
    [device] = spec["devices"]
    assert device["containerEdits"]["deviceNodes"][0]["path"] == f"/dev/nvidia{gpu.minor}"
    driver = DriverRoot.of(DRIVER_ROOT, "", DEV_ROOT)
    version = driver.driver_version()
    mounts = [m["containerPath"] for m in spec["containerEdits"]["mounts"]]
    assert any(p.endswith(f"libnvidia-ml.so.{version}") for p in mounts), mounts
    if driver.find_library("libcuda.so.1"):  # a real node; NVIDIA's mock NVML ships no CUDA library
        assert any(p.endswith(f"libcuda.so.{version}") for p in mounts), mounts


async def test_mig_claim_prepares_on_a_mig_enabled_gpu(root: Path, bus: Bus, real_discovery: RunningDiscovery) -> None:
    migs = [m for g in real_discovery.inventory.gpus for m in g.mig_devices]
    if not migs:
        pytest.skip("no MIG device on this node (enable MIG mode and create an instance to run this)")
    mig = migs[0]
    spec = await _prepare_unprepare(root, bus, claim_doc(name="mig", node=NODE, results=[("mig", mig.name)]))
    paths = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert sorted(paths[1:]) == sorted(mig.device_path_caps)


async def test_mps_claim_starts_and_stops_the_control_daemon(
    root: Path, bus: Bus, real_discovery: RunningDiscovery
) -> None:
    if not DriverRoot.of(DRIVER_ROOT, "", DEV_ROOT).find_binary("nvidia-cuda-mps-control"):
        pytest.skip("no nvidia-cuda-mps-control in the driver root")
    gpu = real_discovery.inventory.gpus[0]
    spec = await _prepare_unprepare(
        root,
        bus,
        claim_doc(
            name="mps",
            node=NODE,
            results=[("gpu", gpu.name)],
            configs=[gpu_config({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}})],
        ),
    )
    env = spec["devices"][0]["containerEdits"]["env"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in env
