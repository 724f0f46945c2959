"""kubernetes-asyncio loads its generated classes, its kubeconfig loader and the modules its client imports
for paths not taken only when used (shared.kube.lazyload), in a fresh interpreter so the test sees what a
service process sees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import sys
import shared  # installs the light package
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException
loaded = [m for m in sys.modules if m.startswith("kubernetes_asyncio.client.models.")
          or m.startswith("kubernetes_asyncio.client.api.")]
print("light", len(loaded))
in_pod = config.load_incluster_config, config.ConfigException
deferred = ("urllib3", "dateutil.parser", "multiprocessing.pool", "yaml")
print("deferred", ",".join(m for m in deferred if m in sys.modules) or "-")
cfg = Configuration()
cfg.username, cfg.password = "u", "p"
print("basic", cfg.get_basic_auth_token(), type(sys.modules["urllib3"]).__name__)
print("kubeconfig", config.load_kube_config.__module__, "yaml" in sys.modules)
import kubernetes_asyncio
print("version", kubernetes_asyncio.__version__)
pod = client.V1Pod(metadata=client.V1ObjectMeta(name="p"))
print("model", type(pod).__module__, pod.metadata.name)
print("api", client.CoreV1Api.__module__)
from kubernetes_asyncio.client.models import V1Status
from kubernetes_asyncio import watch
print("status", V1Status.__name__, watch.Watch.__name__, client.models.V1Pod is type(pod))
"""


def test_models_load_only_when_used() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["light"] == "0", "generated API/model modules were imported before any use"
    assert lines["deferred"] == "-", "modules for paths not taken were imported before any use"
    assert lines["basic"] == "Basic dTpw module"  # the real urllib3, imported at its first use
    assert lines["kubeconfig"] == "kubernetes_asyncio.config.kube_config True"
    assert lines["version"][0].isdigit()
    assert lines["model"] == "kubernetes_asyncio.client.models.v1_pod p"
    assert lines["api"] == "kubernetes_asyncio.client.api.core_v1_api"
    assert lines["status"] == "V1Status Watch True"
