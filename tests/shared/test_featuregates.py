"""Feature gates through the one config path: a bad setting stops a real service at start naming it;
`gpu-dra features` lists the gates; the metric says which are on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from shared import featuregates
from shared.config import CommonConfig, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def gpu_dra(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_")}
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("Nope=true", "unknown feature gate 'Nope'"),
        ("DynamicMIG=maybe", "feature gate DynamicMIG: value 'maybe' is not true or false"),
    ],
)
def test_a_bad_setting_stops_a_service_naming_it(setting: str, message: str) -> None:
    done = gpu_dra("publisher", env={"GPU_DRA_FEATURE_GATES": setting})
    assert done.returncode == 2
    assert f"invalid setting GPU_DRA_FEATURE_GATES: {message}" in done.stderr
    with pytest.raises(ConfigError, match="invalid setting --feature-gates"):
        load_config(CommonConfig, ["--feature-gates", setting], prog="t", env={})


def test_a_gate_that_requires_another_is_refused_alone() -> None:
    registry = {
        g.name: g
        for g in (
            featuregates.Gate(name="Base", stage="Alpha", default=False, description="b"),
            featuregates.Gate(name="Top", stage="Alpha", default=False, requires=("Base",), description="t"),
        )
    }
    with pytest.raises(featuregates.FeatureGateError, match="feature gate Top requires Base to be enabled too"):
        featuregates.parse("Top=true", registry)
    assert featuregates.parse("Top=true,Base=true", registry).enabled("Top")


@pytest.mark.parametrize(
    ("command", "gate"),
    [
        (["publisher", "--passthrough"], "PassthroughSupport"),
        (["discovery", "--simulate", "h100x1", "--fabric-manager-partitions"], "FabricManagerPartitioning"),
    ],
)
def test_a_feature_flag_without_its_gate_stops_the_service_naming_the_gate(command: list[str], gate: str) -> None:
    done = gpu_dra(*command, env={})
    assert done.returncode == 2 and f"--feature-gates {gate}=true" in done.stderr, done.stderr[-2000:]


def test_gates_default_override_and_list() -> None:
    cfg = load_config(CommonConfig, ["--feature-gates", "DynamicMIG=false, PassthroughSupport=true"], prog="t", env={})
    assert cfg.gates.enabled("DynamicMIG") is False and cfg.gates.enabled("PassthroughSupport") is True
    assert cfg.gates.enabled("ConsumableShares") is True  # its default
    done = gpu_dra("features", "--feature-gates", "DynamicMIG=false", env={})
    assert done.returncode == 0
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("DynamicMIG "))
    assert row[:4] == ["DynamicMIG", "Beta", "true", "false"]
    with pytest.raises(featuregates.FeatureGateError, match="GA and always on"):
        featuregates.parse("X=false", {"X": featuregates.Gate(name="X", stage="GA", default=True, description="")})


def test_the_metric_says_which_gates_are_on() -> None:
    featuregates.export(featuregates.parse("DynamicMIG=false"))
    value = REGISTRY.get_sample_value("gpu_dra_feature_enabled", {"name": "DynamicMIG", "stage": "Beta"})
    assert value == 0
    assert REGISTRY.get_sample_value("gpu_dra_feature_enabled", {"name": "ConsumableShares", "stage": "Beta"}) == 1
