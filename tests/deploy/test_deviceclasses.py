"""The DeviceClasses in deploy/ are the ones `gpu-dra up` installs (shared.deviceclasses.device_classes):
resource.k8s.io/v1 with `extendedResourceName: nvidia.com/gpu` for Kubernetes 1.34+, and through the
resource-v1beta1 component the v1beta1 objects without it for 1.32/1.33."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import CustomObjectsApi

from embedded.apiserver.testing import running_apiserver
from embedded.cluster.local import ClusterConfig, LocalCluster
from shared.deviceclasses import device_classes
from tests.deploy.conftest import KUBERNETES, OVERLAYS, render_overlay, render_overlay_v1beta1


def _by_name(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "DeviceClass"}


def _without_labels(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, obj in _by_name(objects).items():
        obj = copy.deepcopy(obj)
        obj["metadata"].pop("labels", None)
        out[name] = obj
    return out


def test_the_base_file_holds_the_v1_classes() -> None:
    shipped = list(yaml.safe_load_all((KUBERNETES / "base" / "deviceclasses.yaml").read_text()))
    assert _without_labels(shipped) == _without_labels(device_classes("v1"))
    assert _by_name(shipped)["gpu.nvidia.com"]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    vfio = _by_name(shipped)["vfio.gpu.nvidia.com"]["spec"]["selectors"][0]["cel"]["expression"]
    assert vfio.endswith("device.attributes['gpu.nvidia.com'].type == 'vfio'")


async def test_gpu_dra_up_installs_exactly_the_shipped_classes(tmp_path: Path) -> None:
    """`gpu-dra up`'s install step against the embedded API server; the classes read back equal the file."""
    shipped = _without_labels(list(yaml.safe_load_all((KUBERNETES / "base" / "deviceclasses.yaml").read_text())))
    async with running_apiserver(tmp_path / "api") as api, api.client() as client:
        cluster = LocalCluster(ClusterConfig(nodes=1, data_dir=str(tmp_path / "cluster")))
        cluster.api = client
        await cluster._install_cluster_objects()
        listed = await CustomObjectsApi(client).list_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses")
    installed = {}
    for obj in listed["items"]:
        obj["apiVersion"], obj["kind"] = "resource.k8s.io/v1", "DeviceClass"
        obj["metadata"] = {"name": obj["metadata"]["name"]}
        installed[obj["metadata"]["name"]] = obj
    assert installed == shipped


@pytest.mark.kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_classes_equal_gpu_dra_up_on_1_34(overlay: str) -> None:
    assert _by_name(render_overlay(overlay)) == _by_name(device_classes("v1"))


@pytest.mark.kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_classes_with_the_v1beta1_component_equal_the_v1beta1_classes(overlay: str) -> None:
    rendered = _by_name(render_overlay_v1beta1(overlay))
    assert rendered == _by_name(device_classes("v1beta1"))
    assert "extendedResourceName" not in rendered["gpu.nvidia.com"]["spec"]
