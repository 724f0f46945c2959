"""Admission webhook benchmark: what a good claim's admission costs at `kubectl apply`.

The real `gpu-dra webhook --self-signed` process, registered in the embedded API server (in this process,
over real HTTPS); this process is also the client. Figures: (1) the webhook's own round trip, an
AdmissionReview POSTed to /validate over TLS (p50/p99); (2) ResourceClaim creates with the webhook
registered and (3) without, each p50/p99, and the difference (what admission adds to a create, the
server's dry run for the review included). Goal: a good claim's admission p99 <= 20 ms.
Writes bench/results/webhook.json.

    .venv/bin/python bench/webhook_bench.py [--claims 400]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import re
import ssl
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedded.apiserver.testing import running_apiserver  # noqa: E402
from services.webhook import registration  # noqa: E402

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
VWC = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


def good_claim(name: str) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
                "config": [
                    {
                        "requests": ["gpu"],
                        "opaque": {
                            "driver": "gpu.nvidia.com",
                            "parameters": {
                                "apiVersion": "resource.nvidia.com/v1beta1",
                                "kind": "GpuConfig",
                                "sharing": {
                                    "strategy": "MPS",
                                    "mpsConfig": {
                                        "defaultActiveThreadPercentage": 50,
                                        "defaultPinnedDeviceMemoryLimit": "10Gi",
                                    },
                                },
                            },
                        },
                    }
                ],
            }
        },
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)


_DRAINS: list[asyncio.Task[bytes]] = []  # the webhook's stderr, read to its end so the pipe never fills


async def start_webhook(cert_dir: Path) -> tuple[asyncio.subprocess.Process, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        "webhook",
        "--self-signed",
        "--cert-dir",
        str(cert_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    while True:
        line = (await proc.stderr.readline()).decode()
        if not line:
            raise SystemExit("the webhook exited before serving")
        found = re.search(r"url=(https://\S+)", line)
        if found:
            _DRAINS.append(asyncio.create_task(proc.stderr.read()))
            return proc, found.group(1)


async def creates(
    http: aiohttp.ClientSession, url: str, headers: dict, ctx: ssl.SSLContext, prefix: str, count: int
) -> list[float]:
    took = []
    for i in range(count):
        started = time.perf_counter()
        async with http.post(url + CLAIMS, json=good_claim(f"{prefix}-{i}"), headers=headers, ssl=ctx) as resp:
            await resp.read()
            assert resp.status == 201, resp.status
        took.append(time.perf_counter() - started)
    return took


async def main(count: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc, hook_url = await start_webhook(Path(tmp) / "certs")
        try:
            async with running_apiserver(Path(tmp)) as api, aiohttp.ClientSession() as http:
                server = api.server
                ctx = ssl.create_default_context(cadata=server.ca_pem.decode())
                headers = {"Authorization": f"Bearer {server.token}"}
                bundle = base64.b64encode((Path(tmp) / "certs" / "webhook.crt").read_bytes()).decode()
                hook_ctx = ssl.create_default_context(cafile=str(Path(tmp) / "certs" / "webhook.crt"))
                review = {
                    "apiVersion": "admission.k8s.io/v1",
                    "kind": "AdmissionReview",
                    "request": {
                        "uid": "bench",
                        "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
                        "operation": "CREATE",
                        "object": good_claim("review"),
                    },
                }
                direct = []
                for _ in range(count):
                    started = time.perf_counter()
                    async with http.post(hook_url, json=review, ssl=hook_ctx) as resp:
                        assert (await resp.json())["response"]["allowed"] is True
                    direct.append(time.perf_counter() - started)
                await creates(http, server.url, headers, ctx, "warm", 20)
                without = await creates(http, server.url, headers, ctx, "plain", count)
                body = registration.configuration({"url": hook_url, "caBundle": bundle})
                async with http.post(server.url + VWC, json=body, headers=headers, ssl=ctx) as resp:
                    assert resp.status == 201, await resp.text()
                await creates(http, server.url, headers, ctx, "warm-hooked", 20)
                hooked = await creates(http, server.url, headers, ctx, "hooked", count)
        finally:
            proc.terminate()
            await proc.wait()
    return {
        "what": "a good ResourceClaim's admission: the real webhook process, the embedded API server in the "
        "client's process, HTTPS throughout",
        "claims": count,
        "webhook_round_trip_ms": {"p50": pct(direct, 0.5), "p99": pct(direct, 0.99)},
        "create_with_webhook_ms": {"p50": pct(hooked, 0.5), "p99": pct(hooked, 0.99)},
        "create_without_webhook_ms": {"p50": pct(without, 0.5), "p99": pct(without, 0.99)},
        "admission_added_ms": {
            "p50": round(pct(hooked, 0.5) - pct(without, 0.5), 2),
            "p99": round(pct(hooked, 0.99) - pct(without, 0.99), 2),
        },
        "goal": "admission p99 <= 20 ms",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--claims", type=int, default=400)
    args = parser.parse_args()
    result = asyncio.run(main(args.claims))
    out = ROOT / "bench" / "results" / "webhook.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
