"""Claims refused at `kubectl apply` by the webhook, through the embedded API server calling it as
kube-apiserver does: real kubectl, real HTTPS with the caBundle, the real `gpu-dra webhook` process."""

from __future__ import annotations

import json
from typing import Any

from embedded.apiserver.testing import RunningApiServer
from tests.apiserver.conftest import Kubectl
from tests.webhook.conftest import RunningWebhook, register, running_webhook

GPU_CONFIG = "resource.nvidia.com/v1beta1"
DENIED = 'admission webhook "claims.gpu.nvidia.com" denied the request: '


def claim(
    name: str,
    parameters: Any,
    device_class: str = "gpu.nvidia.com",
    driver: str = "gpu.nvidia.com",
    requests: list[str] | None = None,
) -> str:
    config: dict[str, Any] = {"opaque": {"driver": driver, "parameters": parameters}}
    if requests:
        config["requests"] = requests
    return json.dumps(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}],
                    "config": [config],
                }
            },
        }
    )


def mps(**mps_config: Any) -> dict[str, Any]:
    sharing: dict[str, Any] = {"strategy": "MPS"}
    if mps_config:
        sharing["mpsConfig"] = mps_config
    return {"apiVersion": GPU_CONFIG, "kind": "GpuConfig", "sharing": sharing}


async def refused(kubectl: Kubectl, body: str) -> str:
    rc, out, err = await kubectl("apply", "-f", "-", stdin=body, check=False)
    assert rc != 0, f"accepted: {out}"
    return err


async def test_bad_configs_are_refused_naming_the_field(
    kubectl: Kubectl, api: RunningApiServer, webhook: RunningWebhook
) -> None:
    err = await refused(kubectl, claim("unknown", {**mps(), "sharing": {"strategy": "MPS", "mpsConfg": {}}}))
    assert DENIED in err
    assert (
        "spec.devices.config[0].opaque.parameters: 'FromClaim' config: strict decoding error: unknown field "
        '"sharing.mpsConfg" in GpuConfig'
    ) in err

    err = await refused(kubectl, claim("huge", mps(defaultPinnedDeviceMemoryLimit="1e999999")))
    assert DENIED in err
    assert (
        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: quantity '1e999999': exponent 999999 is out of range" in err
    )

    err = await refused(kubectl, claim("vm", mps(), device_class="vfio.gpu.nvidia.com", requests=["gpu"]))
    assert DENIED in err
    assert "cannot apply GpuConfig to request 'gpu': its device is of type 'vfio'" in err
    assert "field \"sharing.strategy\": 'MPS' sharing does not apply" in err
    assert api.server.store.items(("resource.k8s.io", "resourceclaims")) == []  # nothing stored


async def test_a_good_claim_and_other_drivers_pass(
    kubectl: Kubectl, api: RunningApiServer, webhook: RunningWebhook
) -> None:
    _, out, _ = await kubectl("apply", "-f", "-", stdin=claim("good", mps(defaultActiveThreadPercentage=50)))
    assert "resourceclaim.resource.k8s.io/good created" in out
    other = claim("other", {"anything": True}, device_class="example.com", driver="gpu.example.com")
    _, out, _ = await kubectl("apply", "-f", "-", stdin=other)
    assert "created" in out


async def test_templates_in_v1beta1_are_checked_too(kubectl: Kubectl, webhook: RunningWebhook) -> None:
    template = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com"}],
                    "config": [
                        {
                            "opaque": {
                                "driver": "gpu.nvidia.com",
                                "parameters": {
                                    "apiVersion": GPU_CONFIG,
                                    "kind": "GpuConfig",
                                    "sharing": {
                                        "strategy": "TimeSlicing",
                                        "timeSlicingConfig": {"interval": "Forever"},
                                    },
                                },
                            }
                        }
                    ],
                }
            }
        },
    }
    err = await refused(kubectl, json.dumps(template))
    assert DENIED + "spec.spec.devices.config[0].opaque.parameters:" in err
    assert 'field "sharing.timeSlicingConfig.interval" must be one of Default, Short, Medium, Long' in err


async def test_a_compute_domain_config_is_checked_by_its_own_parser(kubectl: Kubectl, webhook: RunningWebhook) -> None:
    body = claim(
        "cd",
        {"apiVersion": GPU_CONFIG, "kind": "ComputeDomainChannelConfig", "domainID": ""},
        device_class="compute-domain-default-channel.nvidia.com",
        driver="compute-domain.nvidia.com",
    )
    err = await refused(kubectl, body)
    assert DENIED + "spec.devices.config[0].opaque.parameters: ComputeDomainChannelConfig.domainID is empty" in err


async def test_webhook_down_blocks_only_our_claims(kubectl: Kubectl, api: RunningApiServer, tmp_path) -> None:
    async with running_webhook(tmp_path / "certs") as hook:
        await register(kubectl, hook.client_config())
        await hook.stop()
    err = await refused(kubectl, claim("ours", mps()))
    assert 'failed calling webhook "claims.gpu.nvidia.com"' in err
    other = claim("theirs", {"x": 1}, device_class="example.com", driver="gpu.example.com")
    _, out, _ = await kubectl("apply", "-f", "-", stdin=other)
    assert "resourceclaim.resource.k8s.io/theirs created" in out


async def test_a_gate_off_refuses_its_devices(kubectl: Kubectl, tmp_path) -> None:
    async with running_webhook(tmp_path / "certs") as hook:  # PassthroughSupport at its default: off
        await register(kubectl, hook.client_config())
        err = await refused(
            kubectl, claim("vm", {"apiVersion": GPU_CONFIG, "kind": "GpuConfig"}, device_class="vfio.gpu.nvidia.com")
        )
    assert (
        DENIED + "spec.devices.requests[0].exactly: VFIO (passthrough) devices are turned off here "
        "(feature gate PassthroughSupport=false)" in err
    )


async def test_a_wrong_ca_bundle_fails_closed(kubectl: Kubectl, tmp_path) -> None:
    async with running_webhook(tmp_path / "a") as hook, running_webhook(tmp_path / "b") as other:
        await register(kubectl, {"url": hook.url, "caBundle": other.ca_bundle})
        err = await refused(kubectl, claim("ours", mps()))
    assert 'failed calling webhook "claims.gpu.nvidia.com"' in err and "certificate verify failed" in err
