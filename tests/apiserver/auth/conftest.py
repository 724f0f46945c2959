"""The API server of the request-chain tests (authentication, RBAC, impersonation, admission policy, size
limits): the `api` fixture here also takes alice's static token from a token file (user alice, groups dev
and qa); and the requests those tests make, as a given token or as the admin, raw or through kubectl."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from embedded.apiserver.testing import RunningApiServer, running_apiserver
from tests.apiserver.conftest import KUBECTL

REPO = Path(__file__).resolve().parents[3]
ALICE = "alice-token-0123456789"


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[RunningApiServer]:
    tokens = tmp_path / "tokens.csv"
    tokens.write_text(f'{ALICE},alice,1001,"dev,qa"\n')
    async with running_apiserver(tmp_path, token_file=tokens) as server:
        yield server


async def _http(
    api: RunningApiServer,
    method: str,
    path: str,
    token: str,
    body: Any = None,
    raw: bytes | None = None,
    headers: list[tuple[str, str]] | None = None,
) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = [("Authorization", f"Bearer {token}"), ("Content-Type", "application/json"), *(headers or [])]
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, api.url + path, data=data, headers=headers, ssl=False) as resp,
    ):
        text = await resp.text()
        return resp.status, json.loads(text) if text else None


async def _admin(api: RunningApiServer, method: str, path: str, body: Any = None) -> Any:
    status, out = await _http(api, method, path, api.token, body)
    assert status in (200, 201), (status, out)
    return out


async def _grant_alice_pod_reading(api: RunningApiServer) -> None:
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles",
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
    )
    await _admin(
        api,
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings",
        {
            "metadata": {"name": "qa-reads-pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "qa"}],
        },
    )


async def _kubectl(kubeconfig: Path, cache: Path, *args: str) -> tuple[int, str, str]:
    import asyncio
    import os

    assert KUBECTL is not None
    proc = await asyncio.create_subprocess_exec(
        KUBECTL,
        "--cache-dir",
        str(cache),
        *args,
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()
