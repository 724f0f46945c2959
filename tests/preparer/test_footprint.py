"""What the preparer process loads: nothing of the local-cluster world or of other services, not the
OpenTelemetry SDK without an exporter (docs/performance.md, memory). Checked in a fresh
interpreter that goes through the preparer's own start-up: its command's module, its settings, its
Kubernetes client from a (JSON) kubeconfig, and one PreparerService per driver."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import asyncio, json, sys
from shared.cli import registry
import importlib
cli = importlib.import_module(registry(until="preparer").commands["preparer"].module)
from services.preparer.config import parse
from services.preparer.host.service import PreparerService
root = sys.argv[1]
cfg = parse(["--node", "n1", "--registry-dir", root + "/reg", "--plugins-dir", root + "/plugins",
             "--cdi-dir", root + "/cdi", "--boot-id-path", root + "/boot_id", "--kubeconfig", root + "/kubeconfig"])

async def main():
    api = await cli.kube_api_client(cfg.kubeconfig, max_connections=cli.API_CONNECTIONS)
    services = [PreparerService(cfg, cli.KubeClaimSource(api), driver=d) for d in cfg.drivers]
    limit = api.rest_client.pool_manager.connector.limit
    await api.close()
    return len(services), limit

drivers, limit = asyncio.run(main())
print(json.dumps({"modules": sorted(sys.modules), "drivers": drivers, "limit": limit}))
"""

# JSON, as our tools write kubeconfigs: read without PyYAML or kubernetes-asyncio's loader (shared.kube.kubeconfig)
KUBECONFIG = json.dumps(
    {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
)

# packages a preparer must never load: the local-cluster world (not in the production image), other
# services and the OpenTelemetry SDK (only an exporting process loads it). kubernetes-asyncio is loaded
# whole, as its package's __init__ imports it (models, config loader, PyYAML, urllib3, and where installed
# kubernetes-validate for its dynamic client: the embedded extra, not in the production image).
MUST_NOT_LOAD = (
    "embedded",
    "cel",
    "celpy",
    "services.publisher",
    "services.discovery",
    "services.dashboard",
    "services.authcallout",
    "opentelemetry.sdk",
    "tests",
)


def _within(module: str, name: str) -> bool:
    """`module` is `name` or one of its submodules (`name` ending in a dot: only its submodules)."""
    return module.startswith(name) if name.endswith(".") else module == name or module.startswith(name + ".")


def test_preparer_start_loads_only_what_it_uses(tmp_path: Path) -> None:
    (tmp_path / "kubeconfig").write_text(KUBECONFIG)
    (tmp_path / "boot_id").write_text("b\n")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["drivers"] == 2
    assert "services.preparer.gpu.plugin" in seen["modules"] and "services.preparer.channel.driver" in seen["modules"]
    loaded = [m for m in seen["modules"] if any(_within(m, name) for name in MUST_NOT_LOAD)]
    assert loaded == [], f"the preparer loaded modules it must not need: {loaded}"
    assert seen["limit"] == 4
