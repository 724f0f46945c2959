"""Webhook settings: flags and `GPU_DRA_*` environment variables -> WebhookConfig.

Owns the setting names and defaults, and the check that a serving certificate is given or made.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.config import CommonConfig, ConfigError, load_config

DESCRIPTION = (
    "Admission webhook: ResourceClaims and ResourceClaimTemplates whose opaque configs name "
    "gpu.nvidia.com or compute-domain.nvidia.com are checked as the preparer checks them (POST /validate, "
    "AdmissionReview v1, HTTPS)."
)


def _help(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class WebhookConfig(CommonConfig, kw_only=True, forbid_unknown_fields=True):
    host: Annotated[str, _help("address to listen on")] = "0.0.0.0"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535, description="HTTPS port of /validate; 0 picks one")] = 8443
    tls_cert_file: Annotated[str, _help("serving certificate (PEM), e.g. from cert-manager's Secret")] = ""
    tls_key_file: Annotated[str, _help("private key of --tls-cert-file")] = ""
    self_signed: Annotated[
        bool,
        _help(
            "make a self-signed certificate in --cert-dir (for the Service's DNS names) instead of "
            "--tls-cert-file; its PEM is the caBundle, logged at start"
        ),
    ] = False
    cert_dir: Annotated[str, _help("where --self-signed keeps its certificate")] = "/tmp/gpu-dra-webhook"
    service_name: Annotated[str, _help("the webhook's Service name (the self-signed certificate's DNS names)")] = (
        "gpu-dra-webhook"
    )
    service_namespace: Annotated[str, _help("the webhook's Service namespace")] = "gpu-dra"
    patch_configuration: Annotated[
        str,
        _help(
            "with --self-signed: the ValidatingWebhookConfiguration whose caBundle to set to the certificate "
            "(needs --kubeconfig or in-cluster credentials)"
        ),
    ] = ""
    kubeconfig: Annotated[str, _help("kubeconfig for --patch-configuration; empty: in-cluster, then KUBECONFIG")] = ""


def parse(argv: list[str]) -> WebhookConfig:
    """Flags and GPU_DRA_* env -> config; ConfigError on anything unknown, malformed or incomplete."""
    cfg = load_config(WebhookConfig, argv, prog="gpu-dra webhook", description=DESCRIPTION)
    if cfg.self_signed == bool(cfg.tls_cert_file):
        raise ConfigError("give either --tls-cert-file with --tls-key-file, or --self-signed")
    if cfg.tls_cert_file and not cfg.tls_key_file:
        raise ConfigError("--tls-cert-file needs --tls-key-file")
    if cfg.patch_configuration and not cfg.self_signed:
        raise ConfigError("--patch-configuration needs --self-signed (cert-manager injects its own caBundle)")
    return cfg
