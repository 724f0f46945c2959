"""A hostile tenant's CEL selector cannot reach the scheduler: the embedded API server refuses, at create
and update, every ResourceClaim, ResourceClaimTemplate and DeviceClass whose selector's estimated cost
is over kube-apiserver's limit (`CELSelectorExpressionMaxCost`), with upstream's 422 and message, in
every served version, to the admin as to a tenant; an ordinary selector from examples/ is accepted.

Over raw HTTP against the embedded API server (its own TLS and tokens); the tenant is a static token
user bound by RBAC to create claims and templates in its namespace.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from embedded.apiserver.testing import RunningApiServer, running_apiserver

REPO = Path(__file__).resolve().parents[2]
TENANT, TENANT_TOKEN, NS = "tenant-a", "tenant-a-token-0123456789", "tenant-a"
GROUP = "/apis/resource.k8s.io"
# the server's work (in this process): estimating, not evaluating, which would take hours. Parsing the
# 6 kB expression is most of it: 19-31 ms alone here, and 76 ms once under the full suite on a slow machine
REFUSE_CPU_MS = 250.0
REFUSE_WALL_MS = 500.0  # the same, however loaded the (shared) machine; evaluating would take hours
FORBIDDEN = "Forbidden: too complex, exceeds cost limit"


def attack(tag: int = 0) -> str:
    """Three nested 500-element `all()` loops around a backtracking-looking regex (~2.6e9 estimated units);
    `tag` makes each expression text new, so no cache answers for it."""
    items = "[" + ",".join(str(i) for i in range(1, 501)) + "]"
    inner = f'device.attributes["gpu.nvidia.com"].productName.matches("^(a+)+{"b" * tag}$")'
    return f"{items}.all(x, {items}.all(y, {items}.all(z, {inner})))"


def example_selector() -> str:
    """A selector shipped in examples/ (MIG with at least 4Gi)."""
    docs = yaml.safe_load_all((REPO / "examples/workloads/mig-static.yaml").read_text())
    for doc in docs:
        for request in ((doc or {}).get("spec", {}).get("spec", {}).get("devices") or {}).get("requests") or []:
            for sel in (request.get("exactly") or request).get("selectors") or []:
                return str(sel["cel"]["expression"])
    raise AssertionError("no selector in examples/workloads/mig-static.yaml")


def _request(version: str, expression: str) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": expression}}]}
    return {"name": "gpu", **(body if version == "v1beta1" else {"exactly": body})}


def claim(version: str, name: str, expression: str) -> dict[str, Any]:
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [_request(version, expression)]}},
    }


def template(version: str, name: str, expression: str) -> dict[str, Any]:
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [_request(version, expression)]}}},
    }


def device_class(version: str, name: str, expression: str) -> dict[str, Any]:
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


# kind -> (collection path, body, field path of the first selector: the internal v1 shape in every version)
KINDS = {
    "ResourceClaim": (
        f"namespaces/{NS}/resourceclaims",
        claim,
        "spec.devices.requests[0].exactly.selectors[0].cel.expression",
    ),
    "ResourceClaimTemplate": (
        f"namespaces/{NS}/resourceclaimtemplates",
        template,
        "spec.spec.devices.requests[0].exactly.selectors[0].cel.expression",
    ),
    "DeviceClass": ("deviceclasses", device_class, "spec.selectors[0].cel.expression"),
}


class Http:
    """One keep-alive session to the API server (timings then measure the request, not TLS set-up).
    The server runs in this process, so the process's CPU time over a request is the server's work
    plus the client's."""

    def __init__(self, api: RunningApiServer, session: aiohttp.ClientSession) -> None:
        self.api, self.session = api, session

    async def call(self, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any, tuple[float, float]]:
        """Status, body, and (wall, CPU) milliseconds of the request."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        start, cpu = time.perf_counter(), time.process_time()
        async with self.session.request(method, self.api.url + path, data=data, headers=headers, ssl=False) as resp:
            text = await resp.text()
            took = ((time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000)
            return resp.status, json.loads(text) if text else None, took


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[Http]:
    tokens = tmp_path / "tokens.csv"
    tokens.write_text(f'{TENANT_TOKEN},{TENANT},2001,"tenants"\n')
    async with running_apiserver(tmp_path, token_file=tokens) as api, aiohttp.ClientSession() as session:
        h = Http(api, session)
        admin = api.token
        for method, path, body in [
            ("POST", "/api/v1/namespaces", {"metadata": {"name": NS}}),
            (
                "POST",
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles",
                {
                    "metadata": {"name": "claims"},
                    "rules": [
                        {
                            "apiGroups": ["resource.k8s.io"],
                            "resources": ["resourceclaims", "resourceclaimtemplates"],
                            "verbs": ["create", "get", "update"],
                        }
                    ],
                },
            ),
            (
                "POST",
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings",
                {
                    "metadata": {"name": "tenant-claims"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "claims"},
                    "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": TENANT}],
                },
            ),
        ]:
            status, out, _ = await h.call(method, path, admin, body)
            assert status == 201, (status, out)
        yield h


def assert_refused(status: int, out: Any, took: tuple[float, float], kind: str, name: str, field: str) -> None:
    assert status == 422, (status, out)
    assert out["reason"] == "Invalid" and out["code"] == 422
    assert out["message"] == f'{kind}.resource.k8s.io "{name}" is invalid: {field}: {FORBIDDEN}', out["message"]
    assert out["details"]["causes"] == [{"reason": "FieldValueForbidden", "message": FORBIDDEN, "field": field}]
    wall_ms, cpu_ms = took
    assert cpu_ms < REFUSE_CPU_MS and wall_ms < REFUSE_WALL_MS, f"refused in {wall_ms:.1f} ms ({cpu_ms:.1f} ms CPU)"


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1beta1"])
async def test_attack_selector_refused_at_create_for_everyone_and_nothing_stored(http: Http, version: str) -> None:
    admin = http.api.token
    tag = 10 * ["v1", "v1beta2", "v1beta1"].index(version)  # texts new to this process: nothing cached
    for kind, (collection, body, field) in KINDS.items():
        users = [admin] if kind == "DeviceClass" else [admin, TENANT_TOKEN]
        for token in users:
            tag += 1
            name = f"evil-{tag}"
            path = f"{GROUP}/{version}/{collection}"
            status, out, took = await http.call("POST", path, token, body(version, name, attack(tag)))
            assert_refused(status, out, took, kind, name, field)
            status, out, _ = await http.call("GET", f"{path}/{name}", admin)
            assert status == 404, (kind, out)
            # The probe can succeed: the same request with a selector from examples/ is stored.
            status, out, _ = await http.call("POST", path, token, body(version, f"fine-{tag}", example_selector()))
            assert status == 201, (kind, status, out)


async def test_attack_selector_refused_at_update(http: Http) -> None:
    admin = http.api.token
    for kind, (collection, body, field) in KINDS.items():
        path = f"{GROUP}/v1/{collection}"
        status, stored, _ = await http.call("POST", path, admin, body("v1", "victim", example_selector()))
        assert status == 201, stored
        changed = body("v1", "victim", attack(7))
        changed["metadata"]["resourceVersion"] = stored["metadata"]["resourceVersion"]
        status, out, took = await http.call("PUT", f"{path}/victim", admin, changed)
        assert status == 422, (kind, status, out)
        if kind == "DeviceClass":  # the one of the three whose spec may change: the cost check refuses it
            assert_refused(status, out, took, kind, "victim", field)
        else:  # an immutable spec: refused as immutable, as upstream does on update
            assert "field is immutable" in out["message"], out["message"]
        status, now, _ = await http.call("GET", f"{path}/{'victim'}", admin)
        assert now["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]


async def test_overlong_selector_refused(http: Http) -> None:
    """Upstream's CELSelectorExpressionMaxLength (10240) comes before any parsing."""
    long = "device.driver == '" + "x" * 10240 + "'"
    status, out, _ = await http.call(
        "POST", f"{GROUP}/v1/namespaces/{NS}/resourceclaims", TENANT_TOKEN, claim("v1", "long", long)
    )
    assert status == 422, out
    assert out["details"]["causes"][0]["field"] == "spec.devices.requests[0].exactly.selectors[0].cel.expression"
    assert out["details"]["causes"][0]["reason"] == "FieldValueTooLong"
