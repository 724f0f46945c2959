"""The device metadata file read from inside a pod on `gpu-dra up`: the container (run in the sandbox) prints the
file at its well-known path and the env var naming it; the printed JSON names the claim's GPU UUID, PCI bus id
and the pod's claim name, as the published slice and the claim say."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from embedded.cluster.local import ClusterConfig, LocalCluster
from services.preparer.gpu.pcisysfs import normal_bdf
from tests.cluster.helpers import apply, device_attributes, edits
from tests.polling import eventually

pytestmark = [pytest.mark.timeout(240)]
PATH = "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/gpu.nvidia.com-metadata.json"
SPEC = f"""\
apiVersion: v1
kind: Namespace
metadata: {{name: meta}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: one-gpu, namespace: meta}}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {{deviceClassName: gpu.nvidia.com}}
---
apiVersion: v1
kind: Pod
metadata: {{name: reader, namespace: meta}}
spec:
  restartPolicy: Never
  containers:
  - name: ctr
    image: ubuntu:24.04
    command: [sh, -c, 'cat {PATH} && echo "FILE=$GPU_DRA_DEVICE_METADATA_FILE"']
    resources: {{claims: [{{name: gpu}}]}}
  resourceClaims:
  - {{name: gpu, resourceClaimTemplateName: one-gpu}}
"""


async def test_a_pod_reads_its_gpus_metadata_file(tmp_path: Path) -> None:
    cfg = ClusterConfig(
        nodes=1,
        gpus="h100x2",
        data_dir=str(tmp_path / "data"),
        start_timeout=120,
        compute_domains=False,
        dashboard=False,
        feature_gates="DeviceMetadata=true",
    )
    async with LocalCluster(cfg) as cluster:
        api = await cluster.api_client()
        spec = tmp_path / "reader.yaml"
        spec.write_text(SPEC)
        await apply(api, spec)
        core = client.CoreV1Api(api)

        async def done() -> dict[str, Any] | None:
            pod = api.sanitize_for_serialization(await core.read_namespaced_pod("reader", "meta"))
            return dict(pod) if pod["status"].get("phase") in ("Succeeded", "Failed") else None

        pod = await functools.partial(eventually, timeout=90.0, every=0.2)(done, "pod reader finished")
        text = str(await core.read_namespaced_pod_log("reader", "meta"))
        assert pod["status"]["phase"] == "Succeeded", text
        body, _, env_line = text.rstrip("\n").rpartition("\n")
        assert env_line == f"FILE={PATH}", text
        metadata = json.loads(body)
        (device,) = edits(pod)["ctr"]["devices"]
        published = (await device_attributes(api))[device]
        assert metadata["kind"] == "DeviceMetadata" and metadata["podClaimName"] == "gpu"
        (got,) = metadata["requests"][0]["devices"]
        assert f"{got['pool']}/{got['name']}" == device
        assert got["attributes"]["uuid"] == {"string": published["uuid"]}
        assert published["uuid"].startswith("GPU-")
        bus_id = got["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
        assert bus_id == normal_bdf(published["resource.kubernetes.io/pciBusID"])
