"""shared.distversion: a distribution's version as importlib.metadata reads it, and nats-py imported without
importlib.metadata (each check in a fresh interpreter: what is loaded is process-wide)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared import distversion

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["nats-py", "nats_py", "NATS.py", "opentelemetry-sdk", "msgspec", "grpcio"])
def test_a_version_is_the_one_importlib_metadata_reads(name: str) -> None:
    assert distversion.version(name) == importlib.metadata.version(name)


def test_a_distribution_not_installed_is_not_found() -> None:
    with pytest.raises(distversion.PackageNotFoundError):
        distversion.version("no-such-distribution-here")


def test_nats_py_is_imported_with_its_version_and_importlib_metadata_stays_unloaded() -> None:
    script = ("import json, sys\nimport shared.bus\nimport nats.aio.client\n"
              "print(json.dumps([nats.aio.client.__version__, 'importlib.metadata' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    version, loaded = json.loads(out.stdout)
    assert version == importlib.metadata.version("nats-py") and loaded is False
