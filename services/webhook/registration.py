"""The ValidatingWebhookConfiguration that routes claims to the webhook: one definition, written by
`gpu-dra up` and shipped in deploy/kubernetes/base/webhook.yaml (a test keeps the two equal).

Scoped so that the webhook being down blocks no one else's claims: `rules` name only ResourceClaims and
ResourceClaimTemplates, and `matchConditions` pass only objects whose configs name one of our drivers
or whose requests name one of our device classes; everything else is never sent (failurePolicy Fail
applies to ours alone).
"""

from __future__ import annotations

from typing import Any

from shared.deviceclasses import CLASSES, DRIVERS, VFIO_CLASS

NAME = "gpu-dra-webhook"
WEBHOOK = "claims.gpu.nvidia.com"
PATH = "/validate"


def _list(items: list[str]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def _ours(devices: str) -> str:
    """CEL: `devices` (a claim spec's devices) has a config naming our driver or a request of our class."""
    drivers, classes = _list(list(DRIVERS)), _list(sorted({*CLASSES, VFIO_CLASS}))
    return (
        f"(has({devices}.config) && {devices}.config.exists(c, has(c.opaque) && c.opaque.driver in {drivers}))"
        f" || (has({devices}.requests) && {devices}.requests.exists(r,"
        f" (has(r.exactly) && r.exactly.deviceClassName in {classes})"
        f" || (has(r.deviceClassName) && r.deviceClassName in {classes})"
        f" || (has(r.firstAvailable) && r.firstAvailable.exists(s, s.deviceClassName in {classes}))))"
    )


MATCH_CONDITION = (
    f"(has(object.spec.devices) && ({_ours('object.spec.devices')}))"
    f" || (has(object.spec.spec) && has(object.spec.spec.devices) && ({_ours('object.spec.spec.devices')}))"
)


def webhook(client_config: dict[str, Any], failure_policy: str = "Fail", timeout_seconds: int = 10) -> dict[str, Any]:
    """The one webhook entry, calling `client_config` (`url`, or `service`; `caBundle` when known)."""
    return {
        "name": WEBHOOK,
        "clientConfig": client_config,
        "rules": [
            {
                "apiGroups": ["resource.k8s.io"],
                "apiVersions": ["v1", "v1beta1", "v1beta2"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["resourceclaims", "resourceclaimtemplates"],
                "scope": "Namespaced",
            }
        ],
        "matchConditions": [{"name": "names-a-gpu-dra-driver-or-class", "expression": MATCH_CONDITION}],
        "failurePolicy": failure_policy,
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": timeout_seconds,
    }


def configuration(client_config: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """The whole ValidatingWebhookConfiguration object."""
    metadata: dict[str, Any] = {"name": NAME, "labels": {"app.kubernetes.io/part-of": "gpu-dra"}}
    if annotations:
        metadata["annotations"] = annotations
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": metadata,
        "webhooks": [webhook(client_config)],
    }
