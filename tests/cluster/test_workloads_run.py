"""Workloads run on the local cluster: containers execute in the sandbox, their logs come back through the API
server's pods/log, their exits drive the pod phase, Jobs complete and crashing containers back off.

One cluster for the module: 1 simulated node with 4 H100s and 2 MIG-partitioned A100s, restarts backing off
from 1.5 s. Pods print `nvidia-smi -L` and env lines as NVIDIA's quickstart workloads do; the tests check the
logs name exactly the devices the claims were allocated (full GPUs, MIG devices, shared ones).
"""

from __future__ import annotations

import asyncio
import functools
import re
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from embedded.cluster.apply import Applier
from embedded.cluster.local import ClusterConfig, LocalCluster
from tests.cluster.helpers import MIG_MACHINE, device_attributes, edits
from tests.polling import eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

PRINT = "nvidia-smi -L; env | grep -E '^(NVIDIA|CUDA)_' | sort"
SHARING = """\
    config:
    - requests: [gpu]
      opaque:
        driver: gpu.nvidia.com
        parameters:
          apiVersion: resource.nvidia.com/v1beta1
          kind: GpuConfig
          sharing: {sharing}
"""
WORKLOADS = """\
apiVersion: v1
kind: Namespace
metadata: {{name: run}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {name}, namespace: run}}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {{deviceClassName: {cls}}}
{config}---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: run}}
spec:
  restartPolicy: Never
  containers:
  - name: ctr
    image: ubuntu:22.04
    command: [bash, -c]
    args: ["{script}"]
    resources: {{claims: [{{name: gpu}}]}}
  resourceClaims:
  - {{name: gpu, resourceClaimName: {name}}}
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    root = tmp_path_factory.mktemp("runcluster")
    machine = root / "machine.yaml"
    machine.write_text(MIG_MACHINE)
    cfg = ClusterConfig(
        nodes=1,
        machine=str(machine),
        data_dir=str(root / "data"),
        start_timeout=120,
        compute_domains=False,
        restart_backoff=1.5,
    )
    async with LocalCluster(cfg) as c:
        yield c


until = functools.partial(eventually, timeout=60.0, every=0.2)


async def pod(api: client.ApiClient, name: str) -> dict[str, Any]:
    return dict(api.sanitize_for_serialization(await client.CoreV1Api(api).read_namespaced_pod(name, "run")))


async def phase_is(api: client.ApiClient, name: str, phase: str) -> dict[str, Any] | None:
    got = await pod(api, name)
    return got if got["status"].get("phase") == phase else None


async def log(api: client.ApiClient, name: str, **params: Any) -> str:
    return str(await client.CoreV1Api(api).read_namespaced_pod_log(name, "run", **params))


async def run_workload(api: client.ApiClient, name: str, cls: str, sharing: str = "") -> tuple[str, set[str]]:
    """Apply one claim and its pod, wait for it to succeed: (its log, the UUIDs its claim was allocated)."""
    config = SHARING.format(sharing=sharing) if sharing else ""
    text = WORKLOADS.format(name=name, cls=cls, config=config, script=PRINT)
    await _apply_text(api, text)
    done = await until(lambda: phase_is(api, name, "Succeeded"), f"pod {name} Succeeded")
    attrs = await device_attributes(api)
    uuids = {attrs[d]["uuid"] for d in edits(done)["ctr"]["devices"]}
    return await log(api, name), uuids


async def _apply_text(api: client.ApiClient, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        await Applier(api).apply_file(Path(f.name))


def named_uuids(text: str) -> set[str]:
    return set(re.findall(r"\(UUID: ((?:GPU|MIG)-[0-9a-f-]+)\)", text))


async def test_full_gpu_and_mig_device_logs_name_exactly_the_allocated_devices(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    text, uuids = await run_workload(api, "full", "gpu.nvidia.com")
    (gpu,) = uuids
    assert named_uuids(text) == {gpu}, text
    assert f"CUDA_VISIBLE_DEVICES={gpu}" in text
    text, uuids = await run_workload(api, "mig", "mig.nvidia.com")
    (mig,) = uuids
    mig_lines = [line for line in text.splitlines() if "MIG" in line and "UUID" in line]
    assert len(mig_lines) == 1 and mig in mig_lines[0], text
    assert f"CUDA_VISIBLE_DEVICES={mig}" in text
    status = (await pod(api, "mig"))["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (status["exitCode"], status["reason"]) == (0, "Completed")


async def test_shared_gpus_show_time_slice_and_mps_in_nvidia_smi(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    global PRINT
    before, PRINT = PRINT, "nvidia-smi -q"
    try:
        ts, ts_uuids = await run_workload(
            api, "ts", "gpu.nvidia.com", "{strategy: TimeSlicing, timeSlicingConfig: {interval: Long}}"
        )
        mps, mps_uuids = await run_workload(
            api, "mps", "gpu.nvidia.com", "{strategy: MPS, mpsConfig: {defaultActiveThreadPercentage: 50}}"
        )
    finally:
        PRINT = before
    assert ts_uuids.pop() in ts and "Time Slice Interval                   : Long" in ts, ts
    assert mps_uuids.pop() in mps and "active thread percentage 50" in mps, mps


async def test_job_completes_and_kubectl_wait_sees_it(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    await _apply_text(
        api,
        """\
apiVersion: batch/v1
kind: Job
metadata: {name: twice, namespace: run}
spec:
  completions: 2
  template:
    spec:
      restartPolicy: Never
      containers:
      - {name: ctr, image: busybox, command: [sh, -c, "echo job done"]}
""",
    )
    kubeconfig = str(cluster.kubeconfig_path)
    done = await asyncio.to_thread(
        subprocess.run,
        [
            "kubectl",
            "--kubeconfig",
            kubeconfig,
            "wait",
            "-n",
            "run",
            "--for=condition=complete",
            "job/twice",
            "--timeout=60s",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    pods = await client.CoreV1Api(api).list_namespaced_pod("run", label_selector="job-name=twice")
    assert [p.status.phase for p in pods.items] == ["Succeeded", "Succeeded"]
    assert await log(api, pods.items[0].metadata.name) == "job done\n"


async def test_crashing_container_backs_off_then_runs_and_logs_have_kubectl_options(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    script = (
        "echo run; if [ -e /run/pod/ok ]; then echo up; trap 'exit 0' TERM; sleep 60 & wait; "
        "else touch /run/pod/ok; echo crash; exit 2; fi"
    )
    await _apply_text(
        api,
        f"""\
apiVersion: v1
kind: Pod
metadata: {{name: crash, namespace: run}}
spec:
  terminationGracePeriodSeconds: 5
  containers:
  - {{name: ctr, image: busybox, command: [sh, -c, "{script}"]}}
""",
    )

    async def state() -> tuple[str, int, bool]:
        status = (await pod(api, "crash"))["status"]
        c = (status.get("containerStatuses") or [{}])[0]
        waiting = (c.get("state") or {}).get("waiting") or {}
        return waiting.get("reason", ""), c.get("restartCount", 0), bool((c.get("state") or {}).get("running"))

    await until(lambda: _backing_off(state), "CrashLoopBackOff", every=0.05)
    await until(lambda: _running_again(state), "running after the back-off")
    ready = await until(lambda: phase_is(api, "crash", "Running"), "Running")
    assert {c["type"]: c["status"] for c in ready["status"]["conditions"]}["Ready"] == "True"
    await until(lambda: _log_has(api, "up"), "the second run's output")
    assert await log(api, "crash", previous=True) == "run\ncrash\n"
    assert await log(api, "crash", tail_lines=1) == "up\n"
    stamped = await log(api, "crash", timestamps=True)
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z run$", stamped.splitlines()[0]), stamped
    follow = await asyncio.to_thread(
        subprocess.Popen,
        ["kubectl", "--kubeconfig", str(cluster.kubeconfig_path), "logs", "-f", "-n", "run", "crash"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert follow.stdout is not None
    first = await asyncio.to_thread(follow.stdout.readline)  # kubectl is streaming
    started = time.monotonic()
    await client.CoreV1Api(api).delete_namespaced_pod("crash", "run")
    out = await asyncio.wait_for(asyncio.to_thread(follow.stdout.read), 30)  # until kubectl ends: the container did
    assert await asyncio.to_thread(follow.wait, 5) == 0
    assert first + out == "run\nup\n", out
    assert time.monotonic() - started < 5, "SIGTERM ended the container well before its grace period"
    await until(lambda: _gone(api, "crash"), "the pod deleted once its container stopped", timeout=10)


async def _gone(api: client.ApiClient, name: str) -> bool:
    try:
        await pod(api, name)
    except client.ApiException as exc:
        return exc.status == 404
    return False


async def _backing_off(state: Callable[[], Awaitable[tuple[str, int, bool]]]) -> bool:
    reason, restarts, _ = await state()
    return reason == "CrashLoopBackOff" and restarts == 1


async def _running_again(state: Callable[[], Awaitable[tuple[str, int, bool]]]) -> bool:
    _, restarts, running = await state()
    return restarts >= 1 and running


async def _log_has(api: client.ApiClient, text: str) -> bool:
    try:
        return text in await log(api, "crash")
    except client.ApiException:
        return False


async def test_deployment_rolls_to_a_new_template(cluster: LocalCluster) -> None:
    api = await cluster.api_client()
    apps = client.AppsV1Api(api)
    template = {
        "metadata": {"labels": {"app": "web"}},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "ctr",
                    "image": "busybox",
                    "command": ["sh", "-c", "echo v=$V; trap 'exit 0' TERM; sleep 60 & wait"],
                    "env": [{"name": "V", "value": "1"}],
                }
            ],
        },
    }
    await apps.create_namespaced_deployment(
        "run",
        {  # type: ignore[arg-type]  # the client sends a dict as it is
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "run"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}}, "template": template},
        },
    )
    kubectl = ["kubectl", "--kubeconfig", str(cluster.kubeconfig_path), "-n", "run"]

    async def rollout() -> None:
        done = await asyncio.to_thread(
            subprocess.run,
            [*kubectl, "rollout", "status", "deployment/web", "--timeout=60s"],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert done.returncode == 0, done.stderr + done.stdout

    await rollout()
    template["spec"]["containers"][0]["env"][0]["value"] = "2"  # type: ignore[index]
    await apps.patch_namespaced_deployment("web", "run", {"spec": {"template": template}})
    await rollout()

    async def rolled() -> list[str] | None:
        listed = await client.CoreV1Api(api).list_namespaced_pod("run", label_selector="app=web")
        pods = [p for p in listed.items if p.metadata.deletion_timestamp is None]
        logs = [await log(api, p.metadata.name) for p in pods if p.status.phase == "Running"]
        return logs if len(listed.items) == 2 and logs == ["v=2\n", "v=2\n"] else None

    await until(rolled, "two new pods printing v=2, the old ones gone")


async def test_the_fleet_page_draws_the_mig_layout_the_slices_publish(cluster: LocalCluster) -> None:
    """`up` starts the dashboard: its /api/fleet has the node, each MIG device placed on its parent GPU at the
    memory slices its ResourceSlice device covers."""
    api = await cluster.api_client()
    listed = await client.CustomObjectsApi(api).list_cluster_custom_object("resource.k8s.io", "v1", "resourceslices")
    published = {
        d["name"]: sorted(int(k[len("memorySlice") :]) for k in d.get("capacity", {}) if k.startswith("memorySlice"))
        for s in listed["items"]
        if s["spec"]["driver"] == "gpu.nvidia.com"
        for d in s["spec"]["devices"]
    }
    async with aiohttp.ClientSession() as http, http.get(cluster.dashboard_url + "api/fleet") as resp:
        assert resp.status == 200
        fleet = await resp.json()
    (node,) = fleet["nodes"]
    devices = {d["name"]: d for d in node["devices"]}
    migs = {name: d for name, d in devices.items() if d["type"] == "mig"}
    assert len(migs) == 8 and set(migs) <= set(published)
    for name, d in migs.items():
        assert [d["mig"]["start"], d["mig"]["size"]] == [published[name][0], len(published[name])], name
        assert devices[d["parent"]]["migSlots"] == 8
    assert (
        fleet["counters"]["NVIDIA H100 80GB HBM3"]["free"] + fleet["counters"]["NVIDIA H100 80GB HBM3"]["claimed"] == 4
    )
