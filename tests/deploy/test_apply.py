"""Apply each rendered overlay to the embedded API server with `kubectl apply --server-side=false`,
validation on (kubectl finds server-side field validation in the OpenAPI v3 documents). Every object
must be created: a kind the server does not serve fails the test by name."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import yaml

from embedded.apiserver.testing import running_apiserver
from tests.deploy.conftest import OVERLAYS, kubectl_binary, render_overlay

MISSING = re.compile(r'no matches for kind "(\w+)" in version "([\w./]+)"')


@pytest.mark.parametrize("overlay", OVERLAYS)
async def test_overlay_applies_to_the_embedded_api_server(tmp_path: Path, overlay: str) -> None:
    kubectl = kubectl_binary()
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(render_overlay(overlay)))
    async with running_apiserver(tmp_path) as api:
        proc = await asyncio.create_subprocess_exec(
            kubectl,
            "apply",
            "--server-side=false",
            "-f",
            str(manifest),
            env=api.kubectl_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    errors = [line for line in err.decode().splitlines() if line and "ensure CRDs are installed first" not in line]
    missing = sorted({f"{m.group(2)} {m.group(1)}" for line in errors if (m := MISSING.search(line))})
    other = [line for line in errors if not MISSING.search(line)]
    assert other == [], "\n".join(other)
    assert missing == [], f"the embedded API server does not serve {', '.join(missing)}"
    assert "created" in out.decode()
    assert proc.returncode == 0, err.decode()
