"""kubectl 1.32 against the embedded server, as users drive it: apply the upstream quickstart
workloads, get (table, yaml), watch, patch (merge, json, strategic), wait for a condition,
explain, delete, and a 422 for a slice with 129 devices. Skips where kubectl is absent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import yaml
from kubernetes_asyncio import client, watch

from embedded.apiserver.testing import RunningApiServer
from tests.apiserver.conftest import REFERENCE, Kubectl

WORKLOADS = REFERENCE / "workloads"


def _workloads() -> list[Path]:
    return sorted(WORKLOADS.glob("*.yaml"))


async def test_apply_every_reference_workload_then_get_and_delete(kubectl: Kubectl, api: RunningApiServer) -> None:
    files = _workloads()
    assert files
    for crd in ("computedomain-crd.yaml", "computedomainclique-crd.yaml"):  # the imex workload needs them
        if (REFERENCE / crd).exists():
            await kubectl("apply", "-f", str(REFERENCE / crd))
    known_namespaces = {"default", "kube-system", "kube-public", "kube-node-lease"}
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        known_namespaces |= {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"}
        # An object in a namespace the file never creates is refused, as a real server refuses it.
        orphans = {
            d["metadata"]["namespace"]
            for d in docs
            if d["kind"] != "Namespace" and d["metadata"].get("namespace", "default") not in known_namespaces
        }
        _, out, err = await kubectl("apply", "-f", str(path), check=not orphans)
        for ns in orphans:
            assert f'namespaces "{ns}" not found' in err, err
        expected = sum(1 for d in docs if d["kind"] == "Namespace" or d["metadata"].get("namespace") not in orphans)
        applied = [line for line in out.splitlines() if line.endswith((" created", " unchanged", " configured"))]
        assert len(applied) == expected, (out, err)

    every_file = [arg for path in files for arg in ("-f", str(path))]
    _, again, _ = await kubectl("apply", *every_file, check=False)
    assert " created" not in again and " unchanged" in again
    _, table, _ = await kubectl("get", "pods", "-A")
    assert table.splitlines()[0].split() == ["NAMESPACE", "NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    async with api.client() as c:
        pods = await client.CoreV1Api(c).list_pod_for_all_namespaces()
    assert len(table.splitlines()) == len(pods.items) + 1
    _, claims_yaml, _ = await kubectl("get", "resourceclaimtemplates", "-A", "-o", "yaml")
    listed = yaml.safe_load(claims_yaml)
    assert listed["kind"] == "List" and listed["items"]
    assert all(i["apiVersion"] == "resource.k8s.io/v1" for i in listed["items"])
    # --wait=false: kubectl's own client-side throttling would make its per-object wait take seconds.
    await kubectl("delete", *every_file, "--wait=false", "--ignore-not-found")
    created = known_namespaces - {"default", "kube-system", "kube-public", "kube-node-lease"}
    async with api.client() as c:
        core = client.CoreV1Api(c)
        w = watch.Watch()
        async for event in w.stream(core.list_namespace, timeout_seconds=20):
            if event["type"] == "DELETED":
                created.discard(event["object"].metadata.name)
            if not created or not {n.metadata.name for n in (await core.list_namespace()).items} & created:
                break
        await w.close()
    _, left, _ = await kubectl("get", "pods", "-A", "-o", "name")
    assert left.strip() == ""


async def test_get_yaml_patch_and_explain(kubectl: Kubectl) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p1", "labels": {"app": "a"}},
        "spec": {"containers": [{"name": "c", "image": "busybox", "env": [{"name": "A", "value": "1"}]}]},
    }
    await kubectl("apply", "-f", "-", stdin=json.dumps(pod))
    await kubectl("patch", "pod", "p1", "-p", '{"metadata":{"labels":{"tier":"x"}}}')
    await kubectl("patch", "pod", "p1", "--type=merge", "-p", '{"metadata":{"annotations":{"note":"hi"}}}')
    await kubectl("patch", "pod", "p1", "--type=json", "-p", '[{"op":"remove","path":"/metadata/labels/app"}]')
    # Strategic merge: the env list merges by name instead of being replaced.
    await kubectl(
        "patch",
        "pod",
        "p1",
        "-p",
        '{"spec":{"containers":[{"name":"c","env":[{"name":"B","value":"2"}]}]}}',
        check=False,
    )
    _, out, _ = await kubectl("get", "pod", "p1", "-o", "yaml")
    got = yaml.safe_load(out)
    assert got["metadata"]["labels"] == {"tier": "x"}
    assert got["metadata"]["annotations"]["note"] == "hi"
    assert got["metadata"]["resourceVersion"] and got["status"]["phase"] == "Pending"
    _, explained, _ = await kubectl("explain", "resourceslices.spec.devices")
    assert "ResourceSlice" in explained and "devices" in explained


async def test_strategic_merge_patch_merges_lists_by_key(kubectl: Kubectl, api: RunningApiServer) -> None:
    async with api.client() as c:
        await client.CoreV1Api(c).create_namespaced_service_account("default", {"metadata": {"name": "sa"}})
        await client.AppsV1Api(c).create_namespaced_deployment(
            "default",
            {
                "metadata": {"name": "d"},
                "spec": {
                    "selector": {"matchLabels": {"app": "d"}},
                    "template": {
                        "metadata": {"labels": {"app": "d"}},
                        "spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]},
                    },
                },
            },
        )
    await kubectl(
        "patch", "deployment", "d", "-p", '{"spec":{"template":{"spec":{"containers":[{"name":"b","image":"z"}]}}}}'
    )
    _, out, _ = await kubectl("get", "deployment", "d", "-o", "json")
    containers = json.loads(out)["spec"]["template"]["spec"]["containers"]
    assert [(c["name"], c["image"]) for c in containers] == [("a", "x"), ("b", "z")]
    assert json.loads(out)["metadata"]["generation"] == 2


async def test_watch_prints_changes(kubectl: Kubectl, api: RunningApiServer) -> None:
    proc = await kubectl.start("get", "configmaps", "-w", "--output-watch-events")
    assert proc.stdout is not None
    try:
        async with api.client() as c:
            core = client.CoreV1Api(c)
            await core.create_namespaced_config_map("default", {"metadata": {"name": "watched"}})
            lines: list[str] = []
            while not any("watched" in line for line in lines):
                line = await asyncio.wait_for(proc.stdout.readline(), 15)
                assert line, "kubectl get -w ended early"
                lines.append(line.decode())
            await core.delete_namespaced_config_map("watched", "default")
            while True:
                event = (await asyncio.wait_for(proc.stdout.readline(), 15)).decode()
                assert event, "kubectl get -w ended early"
                if "DELETED" in event:
                    break
        assert any(line.split()[:2] == ["ADDED", "watched"] for line in lines), lines
    finally:
        proc.kill()
        await proc.wait()


async def test_wait_for_condition(kubectl: Kubectl, api: RunningApiServer) -> None:
    async with api.client() as c:
        core = client.CoreV1Api(c)
        await core.create_namespaced_pod(
            "default", {"metadata": {"name": "w"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
        )
        waiter = await kubectl.start("wait", "--for=condition=Ready", "pod/w", "--timeout=20s")
        await core.patch_namespaced_pod_status(
            "w", "default", {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
        )
        out, err = await asyncio.wait_for(waiter.communicate(), 25)
    assert waiter.returncode == 0, err.decode()
    assert "pod/w condition met" in out.decode()


async def test_wait_for_crd_established_then_apply_custom_resource(kubectl: Kubectl) -> None:
    crd = REFERENCE / "computedomain-crd.yaml"
    await kubectl("apply", "-f", str(crd))
    name = yaml.safe_load(crd.read_text())["metadata"]["name"]
    _, out, _ = await kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=20s")
    assert "condition met" in out
    doc = yaml.safe_load(crd.read_text())
    version = next(v["name"] for v in doc["spec"]["versions"] if v.get("storage"))
    cr = {
        "apiVersion": f"{doc['spec']['group']}/{version}",
        "kind": doc["spec"]["names"]["kind"],
        "metadata": {"name": "cd1"},
        "spec": {"numNodes": 1, "channel": {"resourceClaimTemplate": {"name": "t"}}},
    }
    await kubectl("apply", "-f", "-", stdin=json.dumps(cr))
    _, listed, _ = await kubectl("get", doc["spec"]["names"]["plural"])
    assert "cd1" in listed
    _, explained, _ = await kubectl("explain", f"{doc['spec']['names']['plural']}.spec")
    assert "numNodes" in explained


async def test_slice_with_129_devices_is_rejected_naming_the_field(kubectl: Kubectl, api: RunningApiServer) -> None:
    big = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "big"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "n1",
            "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": f"gpu-{i}"} for i in range(129)],
        },
    }
    rc, _, err = await kubectl("apply", "-f", "-", stdin=json.dumps(big), check=False)
    assert rc != 0
    assert 'The ResourceSlice "big" is invalid: spec.devices: Too many: 129: must have at most 128 items' in err
    async with api.client() as c:
        assert (await client.ResourceV1Api(c).list_resource_slice()).items == []


async def test_typed_create_subcommands_send_protobuf(kubectl: Kubectl, api: RunningApiServer) -> None:
    await kubectl("create", "namespace", "team")
    await kubectl("create", "configmap", "cfg", "-n", "team", "--from-literal=a=b")
    await kubectl("create", "secret", "generic", "pw", "-n", "team", "--from-literal=k=v")
    await kubectl("create", "serviceaccount", "bot", "-n", "team")
    async with api.client() as c:
        core = client.CoreV1Api(c)
        assert (await core.read_namespaced_config_map("cfg", "team")).data == {"a": "b"}
        secret = await core.read_namespaced_secret("pw", "team")
        assert secret.data == {"k": "dg=="} and secret.type == "Opaque"
        assert (await core.read_namespaced_service_account("bot", "team")).metadata.namespace == "team"
        assert (await core.read_namespace("team")).status.phase == "Active"
    await kubectl("create", "deployment", "web", "--image=nginx", "--replicas=2")
    await kubectl("create", "job", "once", "--image=busybox", "--", "true")
    async with api.client() as c:
        deployment = await client.AppsV1Api(c).read_namespaced_deployment("web", "default")
        assert deployment.spec.replicas == 2
        assert deployment.spec.template.spec.containers[0].image == "nginx"
        job = await client.BatchV1Api(c).read_namespaced_job("once", "default")
        assert job.spec.template.spec.containers[0].command == ["true"]


async def test_get_nodes_wide_has_upstreams_columns(kubectl: Kubectl) -> None:
    await kubectl(
        "apply",
        "-f",
        "-",
        stdin="""
apiVersion: v1
kind: Node
metadata: {name: n1}
status:
  addresses: [{type: Hostname, address: n1}, {type: InternalIP, address: 10.0.0.7}]
  nodeInfo: {kubeletVersion: v1.34.0, osImage: Ubuntu 24.04, kernelVersion: 6.8.0, containerRuntimeVersion: "",
             machineID: m, systemUUID: u, bootID: b, kubeProxyVersion: "", operatingSystem: linux,
             architecture: amd64}
""",
    )
    _, out, _ = await kubectl("get", "nodes", "-o", "wide")
    header, row = out.splitlines()
    assert header.split() == [
        "NAME",
        "STATUS",
        "ROLES",
        "AGE",
        "VERSION",
        "INTERNAL-IP",
        "EXTERNAL-IP",
        "OS-IMAGE",
        "KERNEL-VERSION",
        "CONTAINER-RUNTIME",
    ]
    cells = row.split()
    assert cells[0] == "n1" and cells[4] == "v1.34.0" and cells[5:7] == ["10.0.0.7", "<none>"], row
    assert cells[7:] == ["Ubuntu", "24.04", "6.8.0", "<unknown>"], row
    _, narrow, _ = await kubectl("get", "nodes")
    assert "INTERNAL-IP" not in narrow


async def test_apply_a_list_and_an_unknown_kind_with_the_protobuf_openapi_v2(
    kubectl: Kubectl, api: RunningApiServer
) -> None:
    # kubectl's validation reads /openapi/v2 only as protobuf (gnostic's openapi.v2.Document)
    await kubectl(
        "apply",
        "-f",
        "-",
        stdin="""
apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: ConfigMap, metadata: {name: l1, namespace: default}, data: {a: "1"}}
- {apiVersion: v1, kind: ConfigMap, metadata: {name: l2, namespace: default}, data: {b: "2"}}
""",
    )
    async with api.client() as c:
        names = {cm.metadata.name for cm in (await client.CoreV1Api(c).list_namespaced_config_map("default")).items}
    assert {"l1", "l2"} <= names
    rc, _, err = await kubectl(
        "apply", "-f", "-", check=False, stdin="apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\n"
    )
    assert rc == 1 and 'no matches for kind "Widget" in version "example.com/v1"' in err, err
    assert "proto" not in err
