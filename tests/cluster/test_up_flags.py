"""The flags of `gpu-dra up` that were broken: --dynamic-mig (passed a flag the publisher does not have),
--metrics-port, per-node --gpus with the clique syntax, every profile `--help` lists; one `up` for the lot."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from embedded.cluster.local import ClusterConfig, publisher_argv
from services.discovery import profiles
from services.publisher.config import PublisherConfig
from shared.config import load_config
from tests.cluster.helpers import Up, metrics_base

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")]


def _up_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shared.cli", "up", *args], capture_output=True, text=True, timeout=60)


def test_help_documents_every_flag_and_lists_the_profiles() -> None:
    done = _up_cli("--help")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for index, line in enumerate(lines):  # a flag whose help starts with "(env ...)" has no description
        if line.strip().startswith("--"):
            text = line.strip().split("  ", 1)[1].strip() if "  " in line.strip() else lines[index + 1].strip()
            assert not text.startswith("(env"), f"undocumented flag: {line.strip()}"
    for name in profiles.choices():
        assert name in done.stdout, name
    assert "clique=N" in done.stdout


@pytest.mark.parametrize("profile", profiles.choices())
def test_every_listed_profile_is_accepted_and_a_bad_spec_is_refused_before_starting(profile: str) -> None:
    from embedded.cluster.local import ClusterConfig

    ClusterConfig(gpus=f"{profile}x2;{profile}x1:clique=4")  # raises on a spec discovery would refuse
    if profile == profiles.choices()[0]:
        done = _up_cli("--gpus", "h100x1;h100x1:clique=x")
        assert done.returncode == 2 and "--gpus 'h100x1:clique=x'" in done.stderr and "number" in done.stderr, (
            done.stderr
        )
        done = _up_cli("--machine", "/no/such/machine.yaml")
        assert done.returncode == 2 and "--machine" in done.stderr, done.stderr


def test_dynamic_mig_metrics_port_and_per_node_gpus_with_a_clique(tmp_path: Path) -> None:
    port = metrics_base()
    up = Up(
        tmp_path / "cluster",
        "--dynamic-mig",
        "--metrics-port",
        str(port),
        "--runtime",
        "none",
        "--no-compute-domains",
        "--gpus",
        "a100-40gbx1:mig;gb200x2:clique=3",
    )
    try:
        up.wait_ready()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as reply:
            assert reply.status == 200
        version = subprocess.run(
            [sys.executable, "-m", "shared.cli", "--version"], capture_output=True, text=True, timeout=30
        ).stdout.split()[-1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert re.search(
            rf'gpu_dra_build_info\{{[^}}]*service="gpu-dra-up"[^}}]*version="{re.escape(version)}"', text
        ), [line for line in text.splitlines() if "build_info" in line]
        services = json.loads((tmp_path / "cluster" / "metrics.json").read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{services['publisher']}/metrics", timeout=10) as reply:
            assert f'version="{version}"' in reply.read().decode()  # every service's, the same version
        slices = json.loads(up.kubectl("get", "resourceslices", "-o", "json"))["items"]
        mine = [s for s in slices if s["spec"]["driver"] == "gpu.nvidia.com"]
        node0 = json.dumps([s for s in mine if s["spec"].get("nodeName") == "gpu-node-0"])
        assert "consumesCounters" in node0, "dynamic MIG: node 0's A100 is partitionable"
        node1 = [d for s in mine if s["spec"].get("nodeName") == "gpu-node-1" for d in s["spec"].get("devices") or []]
        whole = [d for d in node1 if "-mig-" not in d["name"]]  # the GB200s are MIG-capable: partitions too
        assert len(whole) == 2 and all(d["attributes"]["nvlinkCliqueID"] == {"int": 3} for d in whole), whole
    finally:
        up.kill()


@pytest.mark.parametrize(("dynamic", "expected"), [(True, "dynamic"), (False, "static")])
def test_dynamic_mig_reaches_the_publisher_as_its_mig_mode(dynamic: bool, expected: str) -> None:
    prog, *argv = publisher_argv(ClusterConfig(dynamic_mig=dynamic))
    assert prog == "publisher"
    cfg = load_config(PublisherConfig, argv, prog=prog, env={})
    assert cfg.mig_mode == expected
    # counters may come from a NodeConfig rule (mig: dynamic) at any time, and the embedded server takes them only
    # in slices of their own: the layout is named whatever the flags
    assert cfg.counter_layout == "counters-only-slice"


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "node-config"


def test_the_publisher_of_up_watches_node_config_objects_rather_than_a_file() -> None:
    """`up --node-config FILE` makes the file's NodeConfig object (the e2e test shows its effect), so that
    `kubectl apply` changes it live: the publisher is given no file, which would make it ignore objects."""
    example = EXAMPLES / "mps-shares.yaml"
    for dynamic in (False, True):
        prog, *argv = publisher_argv(ClusterConfig(node_config=str(example), dynamic_mig=dynamic))
        assert load_config(PublisherConfig, argv, prog=prog, env={}).node_config == ""


def test_a_bad_node_config_is_one_line_naming_the_field_before_starting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((EXAMPLES / "mps-shares.yaml").read_text().replace("computeStep: 10", "computeStep: 7"))
    for args in (("up", "--node-config", str(bad)), ("demo", "--node-config", str(bad))):
        done = subprocess.run([sys.executable, "-m", "shared.cli", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert "--node-config" in line and "spec.rules[0].computeStep" in line, line
    done = _up_cli("--node-config", str(tmp_path / "missing.yaml"))
    assert done.returncode == 2 and "--node-config" in done.stderr and "missing.yaml" in done.stderr, done.stderr
