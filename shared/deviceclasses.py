"""The DeviceClasses this driver ships, as `resource.k8s.io/v1` objects.

One definition used by `gpu-dra up` and checked against the deploy manifests by the tests
(tests/deploy/test_deviceclasses.py), so the local cluster and a real installation offer the same
classes: `deploy/kubernetes/base/deviceclasses.yaml` holds `device_classes("v1")` (Kubernetes 1.34+,
with `extendedResourceName: nvidia.com/gpu`), and the `components/resource-v1beta1` component turns
it into `device_classes("v1beta1")` for 1.32/1.33. `vfio.gpu.nvidia.com` selects the GPUs offered for VFIO
passthrough (the publisher's --passthrough or a NodeConfig rule's `passthrough`).
"""

from __future__ import annotations

from typing import Any

GPU_DRIVER = "gpu.nvidia.com"
CD_DRIVER = "compute-domain.nvidia.com"
DRIVERS = (GPU_DRIVER, CD_DRIVER)
VFIO_CLASS = "vfio.gpu.nvidia.com"  # offered once VFIO passthrough lands (feature gate PassthroughSupport)
# The kind of `gpu.nvidia.com` device each class selects ("gpu", "mig", "vfio"), as the opaque configs know it.
GPU_DEVICE_KIND = {"gpu.nvidia.com": "gpu", "mig.nvidia.com": "mig", VFIO_CLASS: "vfio"}


def _typed(driver: str, device_type: str, extra: str = "") -> str:
    return f"device.driver == '{driver}' && device.attributes['{driver}'].type == '{device_type}'{extra}"


# name -> (CEL selector, extendedResourceName or "")
CLASSES: dict[str, tuple[str, str]] = {
    "gpu.nvidia.com": (_typed(GPU_DRIVER, "gpu"), "nvidia.com/gpu"),
    "mig.nvidia.com": (_typed(GPU_DRIVER, "mig"), ""),
    "vfio.gpu.nvidia.com": (_typed(GPU_DRIVER, "vfio"), ""),
    "compute-domain-daemon.nvidia.com": (_typed(CD_DRIVER, "daemon"), ""),
    "compute-domain-default-channel.nvidia.com": (
        _typed(CD_DRIVER, "channel", f" && device.attributes['{CD_DRIVER}'].id == 0"),
        "",
    ),
}


def device_class(name: str, api_version: str = "v1") -> dict[str, Any]:
    """One shipped class; `extendedResourceName` only on `v1` (it does not exist in v1beta1)."""
    selector, extended = CLASSES[name]
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": selector}}]}
    if extended and api_version == "v1":
        spec["extendedResourceName"] = extended
    return {
        "apiVersion": f"resource.k8s.io/{api_version}",
        "kind": "DeviceClass",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "gpu-dra"}},
        "spec": spec,
    }


def device_classes(api_version: str = "v1") -> list[dict[str, Any]]:
    return [device_class(name, api_version) for name in CLASSES]
