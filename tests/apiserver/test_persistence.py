"""--data-dir: every object, CRD-served kinds and the resourceVersion sequence survive a restart,
in-process and through the `gpu-dra apiserver` command (a real subprocess, SIGTERM, restart)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio import config as k8s_config

from embedded.apiserver.testing import running_apiserver
from tests.apiserver.conftest import KUBECTL
from tests.apiserver.test_crds import WIDGET_CRD
from tests.apiserver.test_crud import claim_body, slice_body


async def _snapshot(c: client.ApiClient) -> dict[str, str]:
    """name -> resourceVersion of everything the test made."""
    found: dict[str, str] = {}
    for s in (await client.ResourceV1Api(c).list_resource_slice()).items:
        found[f"slice/{s.metadata.name}"] = s.metadata.resource_version
    for cl in (await client.ResourceV1Api(c).list_resource_claim_for_all_namespaces()).items:
        found[f"claim/{cl.metadata.name}"] = cl.metadata.resource_version
    for ns in (await client.CoreV1Api(c).list_namespace()).items:
        found[f"ns/{ns.metadata.name}"] = ns.metadata.resource_version
    widgets = await client.CustomObjectsApi(c).list_namespaced_custom_object("example.com", "v1", "default", "widgets")
    for w in widgets["items"]:
        found[f"widget/{w['metadata']['name']}"] = w["metadata"]["resourceVersion"]
    return found


async def test_objects_and_resource_versions_survive_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with running_apiserver(tmp_path / "one", data_dir=data) as api, api.client() as c:
        await client.ApiextensionsV1Api(c).create_custom_resource_definition(WIDGET_CRD)
        await client.CoreV1Api(c).create_namespace({"metadata": {"name": "team"}})
        for i in range(5):
            await client.ResourceV1Api(c).create_resource_slice(slice_body(f"s{i}"))
        claim = await client.ResourceV1Api(c).create_namespaced_resource_claim("team", claim_body("c1"))
        await client.ResourceV1Api(c).patch_namespaced_resource_claim_status(
            "c1",
            "team",
            {
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "p", "device": "gpu-0"}]
                        }
                    }
                }
            },
        )
        await client.CustomObjectsApi(c).create_namespaced_custom_object(
            "example.com",
            "v1",
            "default",
            "widgets",
            {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w1"}, "spec": {"size": 1}},
        )
        await client.ResourceV1Api(c).delete_resource_slice("s4")
        before = await _snapshot(c)
        last_rv = api.server.store.rv
    assert "slice/s4" not in before and int(claim.metadata.resource_version) < last_rv

    async with running_apiserver(tmp_path / "two", data_dir=data) as api, api.client() as c:
        assert api.server.store.rv == last_rv
        assert await _snapshot(c) == before
        got = await client.ResourceV1Api(c).read_namespaced_resource_claim("c1", "team")
        assert got.status.allocation.devices.results[0].device == "gpu-0"
        later = await client.ResourceV1Api(c).create_resource_slice(slice_body("s9"))
        assert int(later.metadata.resource_version) == last_rv + 1


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
async def test_gpu_dra_apiserver_command_serves_kubectl_and_persists(tmp_path: Path) -> None:
    kubeconfig, data = tmp_path / "kubeconfig", tmp_path / "data"

    async def start() -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "shared.cli",
            "apiserver",
            "--port",
            "0",
            "--kubeconfig",
            str(kubeconfig),
            "--data-dir",
            str(data),
            "--token",
            "s3cret",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert b"apiserver listening on https://127.0.0.1:" in line, line
        return proc

    async def kubectl(*args: str) -> str:
        assert KUBECTL is not None
        proc = await asyncio.create_subprocess_exec(
            KUBECTL,
            "--cache-dir",
            str(tmp_path / "cache"),
            *args,
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return out.decode()

    async def stop(proc: asyncio.subprocess.Process) -> None:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0

    proc = await start()
    try:
        assert yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"] == "s3cret"
        await kubectl("create", "configmap", "kept", "--from-literal=a=b")
        rv = yaml.safe_load(await kubectl("get", "configmap", "kept", "-o", "yaml"))["metadata"]["resourceVersion"]
    finally:
        await stop(proc)
    proc = await start()
    try:
        again = yaml.safe_load(await kubectl("get", "configmap", "kept", "-o", "yaml"))
        assert again["data"] == {"a": "b"} and again["metadata"]["resourceVersion"] == rv
        configuration = client.Configuration()
        await k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        async with client.ApiClient(configuration) as c:
            made = await client.CoreV1Api(c).create_namespaced_config_map("default", {"metadata": {"name": "n"}})
        assert int(made.metadata.resource_version) == int(rv) + 1
    finally:
        await stop(proc)


async def test_bad_flag_is_a_clear_error() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shared.cli",
        "apiserver",
        "--port",
        "not-a-port",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"port" in err


def test_thread_variant_serves_synchronous_callers(tmp_path: Path) -> None:
    import json as _json
    import ssl
    import urllib.request

    from embedded.apiserver.testing import running_apiserver_thread

    with running_apiserver_thread(tmp_path) as api:
        ctx = ssl.create_default_context(cadata=api.server.ca_pem.decode())
        req = urllib.request.Request(f"{api.url}/api/v1/namespaces", headers={"Authorization": f"Bearer {api.token}"})
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:  # verifies the served certificate
            names = [i["metadata"]["name"] for i in _json.load(resp)["items"]]
        assert "default" in names
        assert yaml.safe_load(api.kubeconfig_path.read_text())["clusters"][0]["cluster"]["server"] == api.url


def _in_file(data: Path, name: str) -> tuple[bool, int]:
    """(is the namespace `name` in the server's SQLite file, the resourceVersion on file), read by another
    connection, as a restarted server would."""
    import sqlite3

    conn = sqlite3.connect(data / "apiserver.sqlite")
    try:
        found = conn.execute("SELECT 1 FROM objects WHERE res = 'namespaces' AND name = ?", (name,)).fetchone()
        rv = conn.execute("SELECT v FROM meta WHERE k = 'rv'").fetchone()
        return found is not None, int(rv[0]) if rv else 0
    finally:
        conn.close()


async def test_an_acknowledged_write_is_on_file_when_answered(tmp_path: Path) -> None:
    """A write is answered once committed: a SIGKILL of the server right after the answer keeps it
    (bench/chaos.py lost a pod created just before it killed the API server)."""
    data = tmp_path / "data"
    async with running_apiserver(tmp_path / "one", data_dir=data) as api, api.client() as c:
        core = client.CoreV1Api(c)
        for i in range(20):  # many answers, each checked at once: no time for a write-behind to catch up
            made = await core.create_namespace({"metadata": {"name": f"ns-{i}"}})
            found, on_file = _in_file(data, f"ns-{i}")
            # at least the namespace's write (its `default` ServiceAccount may be on file already too)
            assert found and on_file >= int(made.metadata.resource_version), i
