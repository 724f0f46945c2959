"""The rendered probes of every gpu-dra container point at what the service serves: liveness and startup
at /healthz (or, on the preparer, the gRPC health service) and readiness at /readyz, on the port the
container's own settings give the service (GPU_DRA_METRICS_PORT, GPU_DRA_HEALTHCHECK_PORT), never /metrics.
That those paths and the gRPC service answer is tested on real processes (tests/discovery/test_endpoint.py,
tests/preparer/test_healthcheck.py)."""

from __future__ import annotations

from typing import Any

import pytest

from services.preparer.host.healthcheck import SERVICES as GRPC_HEALTH_SERVICES
from shared.health import LIVENESS_PATH, PATHS, READINESS_PATH
from tests.deploy.conftest import OVERLAYS, render_overlay

pytestmark = pytest.mark.kubectl


def _gpu_dra_containers(overlay: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for obj in render_overlay(overlay):
        if obj["kind"] in ("Deployment", "DaemonSet"):
            for container in obj["spec"]["template"]["spec"]["containers"]:
                if container["image"].split("/")[-1].startswith("gpu-dra:"):
                    out.append((f"{obj['metadata']['name']}/{container['name']}", container))
    return out


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_hit_health_paths_on_the_services_own_ports(overlay: str) -> None:
    containers = _gpu_dra_containers(overlay)
    assert {name for name, _ in containers} >= {
        "gpu-dra-node/discovery",
        "gpu-dra-node/preparer",
        "gpu-dra-node/cd-agent",
        "gpu-dra-publisher/publisher",
        "gpu-dra-controller/controller",
    }
    grpc_probed = set()
    for where, container in containers:
        env = _env(container)
        declared = {p["containerPort"] for p in container.get("ports", [])}
        metrics_port = int(env["GPU_DRA_METRICS_PORT"])
        assert metrics_port in declared, where
        for kind, paths in (
            ("startupProbe", {LIVENESS_PATH}),
            ("livenessProbe", {LIVENESS_PATH}),
            ("readinessProbe", {READINESS_PATH}),
        ):
            probe = container.get(kind)
            assert probe is not None, f"{where} has no {kind}"
            if "grpc" in probe:
                assert kind != "readinessProbe", f"{where}: readiness is /readyz"
                assert probe["grpc"]["port"] == int(env["GPU_DRA_HEALTHCHECK_PORT"]), where
                assert probe["grpc"].get("service", "") in GRPC_HEALTH_SERVICES, where
                assert probe["grpc"]["port"] in declared, where
                grpc_probed.add(where)
                continue
            get = probe["httpGet"]
            assert get["path"] in PATHS and get["path"] in paths, f"{where} {kind} GETs {get['path']}"
            assert get["port"] == metrics_port, (
                f"{where} {kind} probes {get['port']}, the service serves {metrics_port}"
            )
    assert grpc_probed == {"gpu-dra-node/preparer"}, "the preparer's liveness is its gRPC health service"
