"""The shipped ValidatingWebhookConfiguration is the one `gpu-dra up` registers (services/webhook/registration.py),
but for how it reaches the webhook (a Service) and where its caBundle comes from (cert-manager)."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.webhook import registration

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base"


def test_the_shipped_webhook_configuration_is_the_registered_one() -> None:
    docs = [d for d in yaml.safe_load_all((BASE / "webhook.yaml").read_text()) if d]
    [vwc] = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    [service] = [d for d in docs if d["kind"] == "Service"]
    [hook] = vwc["webhooks"]
    target = hook["clientConfig"]["service"]
    assert (target["name"], target["namespace"]) == (service["metadata"]["name"], service["metadata"]["namespace"])
    assert target["port"] == service["spec"]["ports"][0]["port"]
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "gpu-dra/gpu-dra-webhook"
    assert hook == registration.webhook(hook["clientConfig"])
    assert hook["failurePolicy"] == "Fail" and hook["matchConditions"]
