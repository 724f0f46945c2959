"""Discovery's driver-root settings: NVML is loaded from where this process sees the driver root
(`--container-driver-root`), and the preparer's root settings are accepted as they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.discovery.config import parse
from tests.fakedriver import make_driver_root

REPO = Path(__file__).resolve().parents[2]


def test_the_root_settings_are_the_preparers() -> None:
    cfg = parse(
        [
            "--node",
            "n1",
            "--driver-root",
            "/",
            "--container-driver-root",
            "/driver-root",
            "--cdi-hook-path",
            "/usr/local/nvidia/toolkit/nvidia-cdi-hook",
        ]
    )
    assert (cfg.driver_root, cfg.container_driver_root, cfg.local_driver_root) == ("/", "/driver-root", "/driver-root")
    assert cfg.cdi_hook_path == "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    assert parse(["--node", "n1", "--driver-root", "/run/nvidia/driver"]).local_driver_root == "/run/nvidia/driver"


def test_nvml_is_looked_for_under_the_container_driver_root(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "mnt", nvml=False)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "shared.cli",
            "discovery",
            "--once",
            "--node",
            "n1",
            "--driver-root",
            "/",
            "--container-driver-root",
            str(fake.root),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 3, run.stderr
    assert f"no libnvidia-ml.so.1 under driver root {fake.root}" in run.stderr
