"""deploy/'s monitoring (PrometheusRule alerts, Grafana dashboard) against the metrics the services
really export: `gpu-dra up --metrics-port BASE` gives every service a /metrics port, each is scraped
over HTTP and parsed with prometheus_client's parser, and every metric the rules and the dashboard
use must be among them (issue 18)."""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.helpers import Up, metrics_base

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy/kubernetes/components/monitoring/prometheusrule.yaml"
RECORDING = REPO / "deploy/kubernetes/components/monitoring/recordingrules.yaml"
DASHBOARD = REPO / "deploy/monitoring/grafana-dashboard.json"
NAME = re.compile(r"\b((?:nvidia|gpu)_dra_[a-z0-9_]+)")
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")]


def test_the_recording_rules_give_every_reference_name_from_one_of_ours() -> None:
    rules = yaml.safe_load(RECORDING.read_text())["spec"]["groups"][0]["rules"]
    assert all(
        r["record"].startswith("nvidia_dra_") and r["expr"] == "gpu_dra_" + r["record"].removeprefix("nvidia_dra_")
        for r in rules
    ), rules
    assert {"nvidia_dra_requests_total", "nvidia_dra_prepared_devices", "nvidia_dra_compute_domain_info"} <= {
        r["record"] for r in rules
    }


def used_metrics() -> dict[str, str]:
    """Metric names in the alert rules and the dashboard -> where each is used."""
    used: dict[str, str] = {}
    for group in yaml.safe_load(RULES.read_text())["spec"]["groups"]:
        for rule in group["rules"]:
            used.update({name: f"alert {rule['alert']}" for name in NAME.findall(rule["expr"])})
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            used.update({name: f"panel {panel['title']!r}" for name in NAME.findall(target["expr"])})
    return used


def family_of(name: str, families: set[str]) -> str | None:
    if name in families:
        return name
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in families:
            return name.removesuffix(suffix)
    return None


def scrape(port: int, *, within_s: float = 30.0) -> tuple[set[str], str]:
    """The families a /metrics answers with. `gpu-dra up` is ready when the cluster is (nodes, slices):
    a service may still be binding its metrics port then (a scraper retries), so a refused connection
    is tried again until `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            return {f.name for f in text_string_to_metric_families(text)}, text
        except urllib.error.URLError as exc:
            if not isinstance(exc.reason, ConnectionRefusedError) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_every_metric_of_the_alerts_and_the_dashboard_is_exported_by_a_service(tmp_path: Path) -> None:
    used = used_metrics()
    assert len(used) >= 15, used
    base = metrics_base()
    up = Up(tmp_path / "cluster", "--metrics-port", str(base), nodes=1)
    try:
        up.wait_ready()
        ports = json.loads((tmp_path / "cluster/metrics.json").read_text())
        assert set(ports) >= {
            "publisher",
            "computedomain-controller",
            "gpu-node-0-discovery",
            "gpu-node-0-preparer",
            "gpu-node-0-cd-agent",
        }, ports
        exported: dict[str, set[str]] = {}
        for service, port in ports.items():
            families, text = scrape(port)
            exported[service] = families
            assert 'service="' in text and "gpu_dra_build_info" in families, f"{service} has no build info"
            with pytest.raises(urllib.error.HTTPError) as nothing:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/no-such-path", timeout=10)
            assert nothing.value.code == 404
        everything = set().union(*exported.values())
        missing = {name: where for name, where in used.items() if family_of(name, everything) is None}
        assert missing == {}, f"used but exported by no service: {missing}"
        # one prefix: the reference driver's metrics under ours (deploy/'s recording rules add its names)
        assert {
            "gpu_dra_requests",
            "gpu_dra_request_duration_seconds",
            "gpu_dra_prepared_devices",
            "gpu_dra_requests_inflight",
        } <= exported["gpu-node-0-preparer"]
        assert "gpu_dra_compute_domain_info" in exported["computedomain-controller"]
        assert not [f for families in exported.values() for f in families if f.startswith("nvidia_dra_")]
        health = [
            line
            for line in scrape(ports["gpu-node-0-discovery"])[1].splitlines()
            if line.startswith("gpu_dra_device_healthy{")
        ]
        assert health and all('UUID="GPU-' in line or 'UUID="MIG-' in line for line in health), health
        assert all('Hostname="gpu-node-0"' in line and 'modelName="NVIDIA' in line for line in health), health
        assert {"gpu_dra_nvml_scan_duration_seconds", "gpu_dra_xid_events"} <= exported["gpu-node-0-discovery"]
    finally:
        up.kill()
