"""`gpu-dra webhook`: flags -> WebhookConfig -> the HTTPS admission webhook, until SIGINT/SIGTERM.

With `--self-signed` it makes its own certificate (for the Service's DNS names, localhost and
127.0.0.1), logs its caBundle and, given `--patch-configuration NAME`, writes it into that
ValidatingWebhookConfiguration. Exit codes: 0 after a clean stop, 2 for a bad setting, 3 when the
certificate cannot be made or read, or the configuration cannot be patched.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

from services.webhook import config
from services.webhook.server import WebhookServer
from shared.kube import rest as kube
from shared.kube.client import KubeConfigError, kube_api_client
from shared.logs import get_logger
from shared.runtime import service_main
from shared.selfsigned import TlsUnavailable, make_pair, server_context

log = get_logger(__name__)
VWC_PATH = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


class PatchFailed(RuntimeError):
    """The ValidatingWebhookConfiguration could not be read or written."""


def self_signed_pair(cfg: config.WebhookConfig) -> tuple[Path, Path]:
    """The certificate --self-signed serves: its own CA, for the Service's names. Blocking (openssl)."""
    name, ns = cfg.service_name, cfg.service_namespace
    sans = [
        f"DNS:{name}",
        f"DNS:{name}.{ns}",
        f"DNS:{name}.{ns}.svc",
        f"DNS:{name}.{ns}.svc.cluster.local",
        "DNS:localhost",
        "IP:127.0.0.1",
    ]
    return make_pair(Path(cfg.cert_dir), "webhook", common_name=f"{name}.{ns}.svc", sans=sans)


async def patch_ca_bundle(kubeconfig: str, name: str, ca_bundle: str) -> None:
    """Set every webhook's `clientConfig.caBundle` in ValidatingWebhookConfiguration `name`."""
    api = await kube_api_client(kubeconfig)
    try:
        current = kube.decode(await kube.request(api, "GET", f"{VWC_PATH}/{name}"))
        webhooks = [
            {**w, "clientConfig": {**w.get("clientConfig", {}), "caBundle": ca_bundle}}
            for w in current.get("webhooks") or []
        ]
        await kube.request(
            api, "PATCH", f"{VWC_PATH}/{name}", body={"webhooks": webhooks}, content_type="application/merge-patch+json"
        )
    except kube.ApiError as exc:
        raise PatchFailed(f"cannot set the caBundle of ValidatingWebhookConfiguration {name}: {exc}") from None
    finally:
        await api.close()


async def _run(cfg: config.WebhookConfig, stopping: asyncio.Event) -> None:
    if cfg.self_signed:
        cert, key = await asyncio.to_thread(self_signed_pair, cfg)
    else:
        cert, key = Path(cfg.tls_cert_file), Path(cfg.tls_key_file)
    try:
        context = await asyncio.to_thread(server_context, cert, key)
    except OSError as exc:
        raise TlsUnavailable(f"cannot load the serving certificate {cert} / {key}: {exc}") from None
    server = WebhookServer(cfg.gates)
    port = await server.start(cfg.host, cfg.port, context)
    try:
        ca_bundle = ""
        if cfg.self_signed:
            ca_bundle = base64.b64encode(await asyncio.to_thread(cert.read_bytes)).decode()
            if cfg.patch_configuration:
                await patch_ca_bundle(cfg.kubeconfig, cfg.patch_configuration, ca_bundle)
        log.info(
            "webhook serving",
            url=f"https://{cfg.host}:{port}/validate",
            certificate=str(cert),
            caBundle=ca_bundle or "(from the certificate's issuer)",
            feature_gates=cfg.gates.text(),
        )
        await stopping.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    return service_main(
        config.WebhookConfig,
        argv,
        prog="gpu-dra webhook",
        description=config.DESCRIPTION,
        parse=config.parse,
        service=lambda cfg: "webhook",
        run=_run,
        failures=((TlsUnavailable, 3), (PatchFailed, 3), (KubeConfigError, 3)),
    )
