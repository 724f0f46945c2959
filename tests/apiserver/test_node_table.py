"""`kubectl get nodes -o wide`: the Table of nodes has upstream's wide columns (priority 1)."""

from __future__ import annotations

import aiohttp

from embedded.apiserver.testing import RunningApiServer

TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"


async def test_node_table_has_the_wide_columns(api: RunningApiServer) -> None:
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}
    status = {
        "addresses": [{"type": "Hostname", "address": "n1"}, {"type": "InternalIP", "address": "10.0.0.7"}],
        "nodeInfo": {
            "osImage": "Ubuntu 24.04",
            "kernelVersion": "6.8.0",
            "containerRuntimeVersion": "containerd://2.0",
            "machineID": "m",
            "systemUUID": "u",
            "bootID": "b",
            "kubeletVersion": "v1.34.0",
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api.token}"}) as http:
        async with http.post(f"{api.url}/api/v1/nodes", json=node, ssl=False) as resp:
            assert resp.status == 201, await resp.text()
            created = await resp.json()
        async with http.put(f"{api.url}/api/v1/nodes/n1/status", json={**created, "status": status}, ssl=False) as resp:
            assert resp.status == 200, await resp.text()
        async with http.get(f"{api.url}/api/v1/nodes", ssl=False, headers={"Accept": TABLE}) as resp:
            table = await resp.json()
    cols = [(c["name"], c["priority"]) for c in table["columnDefinitions"]]
    assert cols[-5:] == [
        ("Internal-IP", 1),
        ("External-IP", 1),
        ("OS-Image", 1),
        ("Kernel-Version", 1),
        ("Container-Runtime", 1),
    ]
    assert table["rows"][0]["cells"][-5:] == ["10.0.0.7", "<none>", "Ubuntu 24.04", "6.8.0", "containerd://2.0"]
