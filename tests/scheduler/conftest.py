"""Simulated nodes' ResourceSlices (through discovery's and the publisher's real code) and claim helpers."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from embedded.scheduler.simslices import node_slices, simulated_inventory
from shared.deviceclasses import device_classes

WORKLOADS = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "workloads"


def inventory(node: str, spec: str, tmp: Path) -> Any:
    return asyncio.run(simulated_inventory(node, spec, root=tmp))


@pytest.fixture(scope="session")
def sim_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sim")


@pytest.fixture(scope="session")
def h100_inv(sim_root: Path) -> Any:
    return inventory("h100-node", "h100x8", sim_root)


@pytest.fixture(scope="session")
def a100_inv(sim_root: Path) -> Any:
    return inventory("a100-node", "a100-40gbx8", sim_root)


@pytest.fixture(scope="session")
def a100_mig_inv(sim_root: Path) -> Any:
    return inventory("a100-mig", "a100-40gbx8:mig", sim_root)


@pytest.fixture
def h100_slices(h100_inv: Any) -> list[dict[str, Any]]:
    return node_slices(h100_inv)


@pytest.fixture
def classes() -> list[dict[str, Any]]:
    return device_classes()


def claim(name: str, requests: list[dict[str, Any]], namespace: str = "default", **devices: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": requests, **devices}},
    }


def exactly(name: str, device_class: str = "gpu.nvidia.com", *selectors: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": device_class, **extra}
    if selectors:
        body["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": body}


def workload(name: str) -> list[dict[str, Any]]:
    path = WORKLOADS / f"{name}.yaml"
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def template_claim(docs: list[dict[str, Any]], name: str = "") -> dict[str, Any]:
    """The claim a ResourceClaimTemplate (or the ResourceClaim) of a workload file produces."""
    for doc in docs:
        if doc["kind"] == "ResourceClaimTemplate" and (not name or doc["metadata"]["name"] == name):
            spec = copy.deepcopy(doc["spec"]["spec"])
            return {
                "metadata": {
                    "namespace": doc["metadata"]["namespace"],
                    "name": f"{doc['metadata']['name']}-x",
                    "uid": "u",
                },
                "spec": spec,
            }
        if doc["kind"] == "ResourceClaim":
            return copy.deepcopy(doc)
    raise AssertionError("no claim in workload")
