"""The preparer started with --driver-root writes the driver's userspace into every GPU claim spec (full
GPU, MIG, MPS, time-sliced), over its real socket with a kubelet client; the specs validate against the
CDI schema; an unusable --driver-root stops `gpu-dra preparer` at start with exit code 2."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from embedded.harness.discovery import RunningDiscovery
from services.preparer.gpu.commonedits import build_driver_files, control_nodes, edits_of
from shared.bus import Bus
from shared.driverroot import DriverRoot
from tests.fakedriver import make_driver_root
from tests.preparer.cdischema import spec_errors
from tests.preparer.driverfiles import EXPECTED_LIBRARIES, expected_hook_args, upgrade
from tests.preparer.helpers import MemoryClaims, claim_doc, gpu_config, running_node, spec_of

REPO = Path(__file__).resolve().parents[2]


def expected_common(driver: Path) -> dict:
    """The spec-level edits for a fake root, built here independently of the running preparer."""
    root = DriverRoot.of(str(driver))
    return edits_of(build_driver_files(root, f"{driver}/usr/bin/nvidia-cdi-hook"), control_nodes(root)).to_json()


async def test_a_full_gpu_claim_gets_the_driver_userspace_without_nats(claims: MemoryClaims, root: Path) -> None:
    fake = make_driver_root(root / "driver")
    claim = claims.add(claim_doc(name="cuda", results=[("gpu", "gpu-1")]))
    async with running_node(
        claims, root, driver_root=str(fake.root), cdi_hook_path=f"{fake.root}/usr/bin/nvidia-cdi-hook"
    ) as node:
        result = (await node.plugin.prepare([claim]))[claim.uid]
        assert result.error == ""
        spec = spec_of(node.cdi_dir, claim.uid)
    assert spec_errors(spec) == []
    common = spec["containerEdits"]
    assert common == expected_common(fake.root)
    mounted = {m["containerPath"] for m in common["mounts"]}
    assert set(EXPECTED_LIBRARIES) <= mounted and "/usr/bin/nvidia-smi" in mounted
    assert not any("libEGL" in p or "libGLX" in p or "libc.so" in p for p in mounted)
    assert [h["args"] for h in common["hooks"]] == expected_hook_args()
    assert {n["path"] for n in common["deviceNodes"]} == {
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",
    }
    [device] = spec["devices"]  # the GPU's own node, under the driver root (the dev root by default)
    assert device["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia1", "hostPath": f"{fake.root}/dev/nvidia1"}]


async def test_a_container_driver_root_gives_host_paths_and_finds_the_gpu_without_nats(
    claims: MemoryClaims, root: Path
) -> None:
    fake = make_driver_root(root / "mnt")  # the host's /run/nvidia/driver, mounted here
    claim = claims.add(claim_doc(name="operator", results=[("gpu", "gpu-1")]))
    async with running_node(
        claims, root, driver_root="/run/nvidia/driver", container_driver_root=str(fake.root)
    ) as node:
        result = (await node.plugin.prepare([claim]))[claim.uid]  # no inventory yet: /dev/nvidia1 is looked at here
        assert result.error == ""
        spec = spec_of(node.cdi_dir, claim.uid)
    assert spec_errors(spec) == []
    assert str(root) not in json.dumps(spec)
    assert {m["hostPath"] for m in spec["containerEdits"]["mounts"]} >= {
        f"/run/nvidia/driver{p}" for p in EXPECTED_LIBRARIES
    }
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia1", "hostPath": "/run/nvidia/driver/dev/nvidia1"}
    ]


async def test_every_gpu_claim_kind_carries_the_common_edits(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    fake = make_driver_root(root / "driver")
    (fake.root / "tmp" / "nvidia-mps").mkdir(parents=True)  # a node-wide MPS pipe dir: mounted by default
    docs = {
        "full": claim_doc(name="full", results=[("gpu", "gpu-0")]),
        "mig": claim_doc(name="mig", results=[("mig", "gpu-2-mig-1g10gb-19-3")]),
        "mps": claim_doc(name="mps", results=[("gpu", "gpu-3")], configs=[gpu_config({"strategy": "MPS"})]),
        "ts": claim_doc(
            name="ts",
            results=[("gpu", "gpu-4")],
            configs=[gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})],
        ),
    }
    refs = {kind: claims.add(doc) for kind, doc in docs.items()}
    expected = expected_common(fake.root)
    assert "/tmp/nvidia-mps" in {m["containerPath"] for m in expected["mounts"]}
    async with running_node(
        claims, root, bus=bus, driver_root=str(fake.root), cdi_hook_path=f"{fake.root}/usr/bin/nvidia-cdi-hook"
    ) as node:
        results = await node.plugin.prepare(list(refs.values()))
        assert all(r.error == "" for r in results.values()), results
        specs = {kind: spec_of(node.cdi_dir, ref.uid) for kind, ref in refs.items()}
        await node.plugin.unprepare(list(refs.values()))
    for kind, spec in specs.items():
        assert spec_errors(spec) == [], kind
        if kind == "mps":  # the claim's own MPS pipe dir wins over the node-wide one at the same path
            [pipe] = [
                m for m in spec["devices"][0]["containerEdits"]["mounts"] if m["containerPath"] == "/tmp/nvidia-mps"
            ]
            assert pipe["hostPath"].startswith(str(discovery.config.mps_root))
            assert spec["containerEdits"] == {
                **expected,
                "mounts": [m for m in expected["mounts"] if m["containerPath"] != "/tmp/nvidia-mps"],
            }
        else:
            assert spec["containerEdits"] == expected, kind
    mig_nodes = [n["path"] for n in specs["mig"]["devices"][0]["containerEdits"]["deviceNodes"]]
    assert mig_nodes[0] == "/dev/nvidia2" and len(mig_nodes) == 3
    assert all(p.startswith("/dev/nvidia-caps/nvidia-cap") for p in mig_nodes[1:])


async def test_a_missing_hook_is_one_warning_at_start_and_prepares_still_work(
    claims: MemoryClaims, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_driver_root(root / "driver", binaries=("nvidia-smi",))
    claim = claims.add(claim_doc(name="nohook", results=[("gpu", "gpu-0")]))
    with caplog.at_level(logging.WARNING):
        async with running_node(
            claims, root, driver_root=str(fake.root), cdi_hook_path=f"{fake.root}/usr/bin/nvidia-cdi-hook"
        ) as node:
            assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
            spec = spec_of(node.cdi_dir, claim.uid)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "nvidia-cdi-hook is not at" in warnings[0]
    assert "hooks" not in spec["containerEdits"] and spec["containerEdits"]["mounts"]
    assert spec_errors(spec) == []


def _kubeconfig(path: Path) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
            }
        )
    )
    return path


def _no_nvml(base: Path) -> tuple[Path, str]:
    fake = make_driver_root(base, nvml=False)
    return fake.root, f"no libnvidia-ml.so.1 under driver root {fake.root}"


def _mixed(base: Path) -> tuple[Path, str]:
    fake = make_driver_root(base)
    upgrade(fake.root, fake.lib_dir, "560.28.03", cuda=False)
    return fake.root, f"driver root {fake.root} mixes driver versions"


@pytest.mark.parametrize("case", [_no_nvml, _mixed], ids=["no-nvml", "mixed-versions"])
def test_the_preparer_exits_2_naming_an_unusable_driver_root(root: Path, case) -> None:
    driver, message = case(root / "driver")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "shared.cli",
            "preparer",
            "--driver-root",
            str(driver),
            "--drivers",
            "gpu.nvidia.com",
            "--node",
            "n1",
            "--registry-dir",
            str(root / "reg"),
            "--plugins-dir",
            str(root / "plugins"),
            "--cdi-dir",
            str(root / "cdi"),
            "--kubeconfig",
            str(_kubeconfig(root / "kc")),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("gpu-dra preparer: error: ") and message in run.stderr
    assert not (root / "reg" / "gpu.nvidia.com-reg.sock").exists()
    assert not (root / "cdi").exists()


def test_relative_roots_are_bad_settings() -> None:
    from services.preparer.config import ConfigError, parse

    for flag in ("--driver-root", "--container-driver-root", "--dev-root", "--cdi-hook-path"):
        with pytest.raises(ConfigError, match=f"{flag} must be an absolute path"):
            parse([flag, "relative/path"], env={})
    cfg = parse([], env={"GPU_DRA_DRIVER_ROOT": "/", "GPU_DRA_CONTAINER_DRIVER_ROOT": "/driver-root"})
    assert (cfg.driver_root, cfg.container_driver_root, cfg.cdi_hook_path) == (
        "/",
        "/driver-root",
        "/usr/bin/nvidia-cdi-hook",
    )
