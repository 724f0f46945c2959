"""`gpu-dra cdi generate` as a real subprocess on a fake driver root and the simulated NVML: stable output
equal to the expectation files in tests/fixtures/cdi (the driver root's tmp path written as
`<driver-root>`), valid CDI, the container-driver-root case, and the errors of an unusable root.

To refresh an expectation after a deliberate change: run the command as `_generate` does, replace the
root's path with `<driver-root>`, and review the diff."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fakedriver import make_driver_root
from tests.preparer.cdischema import spec_errors
from tests.preparer.driverfiles import expected_hook_args, upgrade

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "cdi"
SIM_VERSION = "550.163.01"  # the simulated GPUs' driver (services/discovery/profiles.py)
LIB = "/usr/lib/x86_64-linux-gnu"


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", "cdi", "generate", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )


@pytest.fixture
def driver(tmp_path: Path) -> Path:
    return make_driver_root(tmp_path / "driver", version=SIM_VERSION).root


def test_h100_node_spec_is_stable_and_as_expected(driver: Path) -> None:
    args = (
        "--driver-root",
        str(driver),
        "--cdi-hook-path",
        f"{driver}/usr/bin/nvidia-cdi-hook",
        "--simulate",
        "h100x2",
    )
    first, second = _generate(*args), _generate(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    assert first.stderr == ""
    spec = json.loads(first.stdout)
    assert spec_errors(spec) == []
    assert spec["kind"] == "k8s.gpu.nvidia.com/device"
    assert [h["args"] for h in spec["containerEdits"]["hooks"]] == expected_hook_args(version=SIM_VERSION)
    names = [d["name"] for d in spec["devices"]]
    assert names[:2] == ["0", "1"] and names[-1] == "all" and len([n for n in names if n.startswith("GPU-")]) == 2
    expected = (FIXTURES / "generate-h100x2.json").read_text()
    assert first.stdout.replace(str(driver), "<driver-root>") == expected


def test_mig_node_spec_as_yaml_file_is_stable_and_as_expected(driver: Path, tmp_path: Path) -> None:
    out = [tmp_path / "one.yaml", tmp_path / "two.yaml"]
    for path in out:
        run = _generate(
            "--driver-root",
            str(driver),
            "--cdi-hook-path",
            f"{driver}/usr/bin/nvidia-cdi-hook",
            "--machine",
            str(FIXTURES / "a100-mig-machine.yaml"),
            "--output",
            str(path),
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout == ""
    text = out[0].read_text()
    assert text == out[1].read_text()
    spec = yaml.safe_load(text)
    assert spec_errors(spec) == []
    by_name = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    assert {"0", "1", "0:0", "0:1", "1:0", "1:1", "all"} <= set(by_name)
    assert len([n for n in by_name if n.startswith("MIG-")]) == 4
    assert by_name["1:0"][0]["path"] == "/dev/nvidia1"  # the parent GPU, then its GI and CI caps
    assert all(n["path"].startswith("/dev/nvidia-caps/nvidia-cap") for n in by_name["1:0"][1:])
    assert text.replace(str(driver), "<driver-root>") == (FIXTURES / "generate-a100-mig.yaml").read_text()


def test_a_container_driver_root_names_host_paths_only(driver: Path) -> None:
    run = _generate(
        "--driver-root", "/run/nvidia/driver", "--container-driver-root", str(driver), "--simulate", "h100x2"
    )
    assert run.returncode == 0, run.stderr
    assert str(driver) not in run.stdout
    spec = json.loads(run.stdout)
    assert {m["hostPath"] for m in spec["containerEdits"]["mounts"]} >= {
        f"/run/nvidia/driver{LIB}/libcuda.so.{SIM_VERSION}",
        "/run/nvidia/driver/usr/bin/nvidia-smi",
    }
    assert {h["path"] for h in spec["containerEdits"]["hooks"]} == {"/usr/bin/nvidia-cdi-hook"}
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}
    ]


def test_a_missing_hook_is_a_warning_and_the_spec_has_no_hooks(tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "driver", version=SIM_VERSION, binaries=("nvidia-smi",)).root
    run = _generate(
        "--driver-root", str(root), "--cdi-hook-path", f"{root}/usr/bin/nvidia-cdi-hook", "--simulate", "h100x2"
    )
    assert run.returncode == 0, run.stderr
    assert f"gpu-dra cdi generate: warning: nvidia-cdi-hook is not at {root}/usr/bin/nvidia-cdi-hook" in run.stderr
    spec = json.loads(run.stdout)
    assert "hooks" not in spec["containerEdits"] and spec_errors(spec) == []


def _no_nvml(tmp_path: Path) -> tuple[Path, str]:
    root = make_driver_root(tmp_path / "driver", version=SIM_VERSION, nvml=False).root
    return root, f"no libnvidia-ml.so.1 under driver root {root}"


def _mixed(tmp_path: Path) -> tuple[Path, str]:
    root = make_driver_root(tmp_path / "driver", version=SIM_VERSION).root
    upgrade(root, LIB, "560.28.03", cuda=False)
    return root, f"driver root {root} mixes driver versions"


def _other_version(tmp_path: Path) -> tuple[Path, str]:
    root = make_driver_root(tmp_path / "driver", version="550.54.15").root
    return root, f"NVML reports driver {SIM_VERSION} but driver root {root} holds 550.54.15"


@pytest.mark.parametrize("case", [_no_nvml, _mixed, _other_version], ids=["no-nvml", "mixed", "nvml-differs"])
def test_an_unusable_driver_root_exits_2_naming_it(tmp_path: Path, case) -> None:
    root, message = case(tmp_path)
    out = tmp_path / "spec.json"
    run = _generate("--driver-root", str(root), "--simulate", "h100x2", "--output", str(out))
    assert run.returncode == 2
    assert run.stderr.startswith("gpu-dra cdi generate: error: ") and message in run.stderr
    assert run.stdout == "" and not out.exists()


def test_bad_flags_exit_2() -> None:
    assert _generate("--driver-root", "relative").returncode == 2
    run = subprocess.run(
        [sys.executable, "-m", "shared.cli", "cdi", "frobnicate"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 2 and "usage: gpu-dra cdi generate" in run.stderr
