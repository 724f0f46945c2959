"""Inventory of simulated machines: names, attribute keys and types, capacities, MIG tables, fabric."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from embedded.harness.discovery import scan_simulated
from shared import devicemodel
from shared.events.inventory import NodeInventory

ATTRIBUTE_TYPES = {
    "type": "string",
    "uuid": "string",
    "productName": "string",
    "brand": "string",
    "architecture": "string",
    "cudaComputeCapability": "version",
    "driverVersion": "version",
    "cudaDriverVersion": "version",
    "addressingMode": "string",
    "resource.kubernetes.io/pciBusID": "string",
    "resource.kubernetes.io/pcieRoot": "string",
    "numaNode": "int",
    "nvlinkClusterUUID": "string",
    "nvlinkCliqueID": "int",
    "parentUUID": "string",
    "profile": "string",
}
SEMVER = r"^\d+\.\d+\.\d+$"


async def scan(tmp_path: Path, spec: str, node: str = "n1") -> NodeInventory:
    return await scan_simulated(tmp_path, node, spec)


def once(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "shared.cli",
            "discovery",
            "--node",
            "n1",
            "--once",
            "--output",
            "json",
            "--dev-root",
            str(tmp_path / "root"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_once_prints_h100x8_inventory(tmp_path):
    done = once(tmp_path, "--simulate", "h100x8")
    assert done.returncode == 0, done.stderr
    inv = msgspec.json.decode(done.stdout, type=NodeInventory)
    assert [g.name for g in inv.gpus] == [f"gpu-{i}" for i in range(8)]
    assert len({g.uuid for g in inv.gpus}) == 8
    assert all(g.product_name == "NVIDIA H100 80GB HBM3" for g in inv.gpus)
    assert all(g.memory_bytes == 80 * 1024**3 for g in inv.gpus)
    assert inv.content_hash and inv.simulated


async def test_h100_device_attributes_have_upstream_keys_and_types(tmp_path):
    inv = await scan(tmp_path, "h100x8")
    assert msgspec.json.decode(msgspec.json.encode(inv), type=NodeInventory) == inv
    numa = set()
    for gpu in inv.gpus:
        dev = devicemodel.full_gpu_device(gpu, inv)
        assert dev["name"] == f"gpu-{gpu.minor}"
        attrs = dev["attributes"]
        for key, value in attrs.items():
            assert key in ATTRIBUTE_TYPES, f"unexpected attribute {key}"
            assert list(value) == [ATTRIBUTE_TYPES[key]], (key, value)
        for required in (
            "type",
            "uuid",
            "productName",
            "brand",
            "architecture",
            "cudaComputeCapability",
            "driverVersion",
            "cudaDriverVersion",
            "resource.kubernetes.io/pciBusID",
            "resource.kubernetes.io/pcieRoot",
            "numaNode",
        ):
            assert required in attrs, required
        assert attrs["type"] == {"string": "gpu"}
        assert attrs["architecture"] == {"string": "Hopper"}
        assert attrs["cudaComputeCapability"] == {"version": "9.0.0"}
        for key in ("cudaComputeCapability", "driverVersion", "cudaDriverVersion"):
            assert __import__("re").match(SEMVER, attrs[key]["version"]), attrs[key]
        assert dev["capacity"] == {"memory": {"value": "80Gi"}}
        numa.add(attrs["numaNode"]["int"])
    assert numa == {0, 1}, "an HGX board spreads its GPUs over two NUMA nodes"


async def test_a100_40gb_mig_table(tmp_path):
    inv = await scan(tmp_path, "a100-40gbx8")
    gpu = inv.gpus[0]
    assert gpu.mig_capable and not gpu.mig_enabled
    table = {p.name: p for p in gpu.mig_profiles}
    assert {"1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"} <= set(table)
    assert len(table["1g.5gb"].placements) == 7
    assert len(table["3g.20gb"].placements) == 2
    assert len(table["7g.40gb"].placements) == 1
    assert table["1g.5gb"].gi_profile_id == 19 and table["7g.40gb"].gi_profile_id == 0
    assert table["1g.5gb"].memory_mib == 4864 and table["1g.5gb"].multiprocessors == 14
    assert [(p.start, p.size) for p in table["3g.20gb"].placements] == [(0, 4), (4, 4)]
    # Ampere cannot toggle MIG without a reset: with MIG off it is offered whole only.
    assert [d["name"] for d in devicemodel.dynamic_mode_devices(gpu, inv)] == ["gpu-0"]
    inv = await scan(tmp_path, "a100-40gbx8:mig", node="n2")
    gpu = inv.gpus[0]
    devices = devicemodel.dynamic_mode_devices(gpu, inv)
    names = [d["name"] for d in devices]
    assert "gpu-0" not in names, "MIG is on and Ampere needs a reset: the full GPU is not offered"
    assert len(names) == sum(len(p.placements) for p in gpu.mig_profiles)
    assert "gpu-0-mig-1g5gb-19-0" in names and "gpu-0-mig-7g40gb-0-0" in names
    one = next(d for d in devices if d["name"] == "gpu-0-mig-1g5gb-19-6")
    assert one["capacity"]["memory"] == {"value": "4864Mi"}
    assert one["consumesCounters"][0]["counterSet"] == "gpu-0-counter-set"
    assert set(one["consumesCounters"][0]["counters"]) >= {"memory", "multiprocessors", "memory-slice-6"}
    cs = devicemodel.counter_set(gpu)
    assert cs is not None and {f"memory-slice-{i}" for i in range(8)} <= set(cs["counters"])


async def test_gb200_reports_fabric_clique(tmp_path):
    inv = await scan(tmp_path, "gb200x4:clique=7")
    assert len(inv.gpus) == 4
    for gpu in inv.gpus:
        assert gpu.fabric is not None and gpu.fabric.clique_id == 7 and gpu.fabric.cluster_uuid
        attrs = devicemodel.full_gpu_device(gpu, inv)["attributes"]
        assert attrs["nvlinkCliqueID"] == {"int": 7}
        assert attrs["addressingMode"] == {"string": "ATS"}
    assert len({g.fabric.cluster_uuid for g in inv.gpus if g.fabric}) == 1


async def test_static_mig_devices_replace_the_full_gpu(tmp_path):
    machine = tmp_path / "machine.yaml"
    machine.write_text(
        "gpus:\n"
        "- profile: a100-40gb\n  mig_enabled: true\n  mig_devices:\n"
        "  - {profile: 3g.20gb, placement: 0}\n  - {profile: 1g.5gb, placement: 4}\n"
        "- profile: t4\n"
    )
    inv = await scan_simulated(tmp_path, "n1", machine=str(machine))
    a100, t4 = inv.gpus
    assert not t4.mig_capable and t4.mig_profiles == []
    devices = devicemodel.default_mode_devices(a100, inv)
    assert [d["name"] for d in devices] == ["gpu-0-mig-3g20gb-9-0", "gpu-0-mig-1g5gb-19-4"]
    first = devices[0]
    assert first["attributes"]["uuid"]["string"].startswith("MIG-")
    assert first["attributes"]["parentUUID"] == {"string": a100.uuid}
    assert {k for k in first["capacity"] if k.startswith("memorySlice")} == {f"memorySlice{i}" for i in range(4)}
    for mig in a100.mig_devices:
        for cap in mig.device_path_caps:
            assert Path(inv.dev_root, cap.lstrip("/")).exists(), cap
    assert [d["name"] for d in devicemodel.default_mode_devices(t4, inv)] == ["gpu-1"]


async def test_unchanged_machine_hashes_the_same(tmp_path):
    first = await scan(tmp_path, "h100x2+l40sx2")
    second = await scan(tmp_path, "h100x2+l40sx2")
    assert first.content_hash == second.content_hash
    assert [g.product_name for g in first.gpus][-1] == "NVIDIA L40S"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--simulate", "h900x8"], "valid profiles: a100-40gb"),
        (["--simulate", "t4x2:mig"], "not MIG-capable"),
        (["--simulate", "h100x8:turbo"], "unknown --simulate option"),
        (["--bogus-flag"], "bogus"),
    ],
)
def test_bad_spec_is_a_clear_error(tmp_path, args, needle):
    done = once(tmp_path, *args)
    assert done.returncode == 2, done.stdout
    assert needle in done.stderr
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").rglob("nvidia0"))


def test_malformed_machine_file_names_the_keys(tmp_path):
    machine = tmp_path / "bad.yaml"
    machine.write_text("gpus:\n- profile: h100\n  colour: green\n")
    done = once(tmp_path, "--machine", str(machine))
    assert done.returncode == 2
    assert "colour" in done.stderr and "expected keys" in done.stderr


def test_missing_nvml_is_a_clear_error(tmp_path):
    empty_root = tmp_path / "driver"
    empty_root.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "shared.cli", "discovery", "--node", "n1", "--once", "--driver-root", str(empty_root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "libnvidia-ml.so.1" in done.stderr
    assert done.stdout == "", "no half inventory on stdout"
