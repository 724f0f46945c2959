"""`gpu-dra up` starts the admission webhook and registers it: the local cluster refuses at `kubectl apply`
the claims the preparer would refuse, with the preparer's message, and takes the good ones."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster.helpers import Up
from tests.webhook.test_admission import DENIED, claim, mps

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")]


def test_up_refuses_a_bad_claim_and_takes_a_good_one(tmp_path: Path) -> None:
    up = Up(tmp_path / "cluster", "--runtime", "none", "--no-dashboard", "--no-compute-domains", nodes=1)
    try:
        up.wait_ready()
        assert up.data_dir is not None
        done = subprocess.run(
            ["kubectl", "--kubeconfig", str(up.kubeconfig), "apply", "-f", "-"],
            text=True,
            input=claim("bad", mps(defaultPinnedDeviceMemoryLimit="1e999999")),
            capture_output=True,
            timeout=60,
        )
        assert done.returncode != 0
        assert DENIED in done.stderr and "defaultPinnedDeviceMemoryLimit" in done.stderr
        out = up.kubectl("apply", "-f", "-", stdin=claim("good", mps(defaultActiveThreadPercentage=20)))
        assert "resourceclaim.resource.k8s.io/good created" in out
        listed = json.loads(up.kubectl("get", "validatingwebhookconfigurations", "-o", "json"))
        [config] = listed["items"]
        assert config["webhooks"][0]["clientConfig"]["url"].startswith("https://127.0.0.1:")
    finally:
        up.kill()
