"""The local cluster's admission webhook: `gpu-dra webhook --self-signed` on a loopback port, registered
as deploy/ registers it (but by URL: the local cluster has no Service network), so the embedded API
server refuses the claims the preparer would refuse, at `kubectl apply`.

    argv = webhook_argv(cert_dir, port)          # started under the supervisor
    await ready(cert_dir, port)                  # True once /healthz answers over its own TLS
    await register(api, cert_dir, port)          # the ValidatingWebhookConfiguration, created or replaced
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from pathlib import Path
from typing import Any

import aiohttp

from services.webhook import registration
from shared.kube import rest as kube

VWC_PATH = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


def webhook_argv(cert_dir: Path, port: int) -> list[str]:
    return ["webhook", "--self-signed", "--cert-dir", str(cert_dir), "--host", "127.0.0.1", "--port", str(port)]


def _cert(cert_dir: Path) -> Path:
    return cert_dir / "webhook.crt"


async def ready(cert_dir: Path, port: int) -> bool:
    """Whether the webhook answers /healthz, its certificate verified against its own caBundle."""
    cert = _cert(cert_dir)
    if not cert.exists():
        return False
    context = await asyncio.to_thread(ssl.create_default_context, cafile=str(cert))
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"https://127.0.0.1:{port}/healthz", ssl=context, timeout=aiohttp.ClientTimeout(total=2)) as resp,
        ):
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def register(api: Any, cert_dir: Path, port: int) -> None:
    """Create (or, kept from an earlier run on this data dir, replace) the ValidatingWebhookConfiguration."""
    bundle = base64.b64encode(await asyncio.to_thread(_cert(cert_dir).read_bytes)).decode()
    body = registration.configuration({"url": f"https://127.0.0.1:{port}{registration.PATH}", "caBundle": bundle})
    try:
        await kube.request(api, "POST", VWC_PATH, body=body)
    except kube.ApiError as exc:
        if exc.status != 409:
            raise
        stored = kube.decode(await kube.request(api, "GET", f"{VWC_PATH}/{registration.NAME}"))
        body["metadata"]["resourceVersion"] = stored["metadata"]["resourceVersion"]
        await kube.request(api, "PUT", f"{VWC_PATH}/{registration.NAME}", body=body)
