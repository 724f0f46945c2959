"""The kubelet emulator's /metrics carries the kubelet's DRA metrics (names, labels, values as pkg/kubelet/metrics has
them): a pod started and deleted on a local cluster shows as one PrepareResources and one UnprepareResources, the
gRPC calls under the plugin's full method name with Go's status code, and the claims in use per driver and `<any>`."""

from __future__ import annotations

import functools
from pathlib import Path

import aiohttp
import grpc
import pytest
from kubernetes_asyncio import client
from prometheus_client.parser import text_string_to_metric_families

from embedded.cluster.local import ClusterConfig, LocalCluster
from embedded.kubelet.metrics import go_code
from tests.cluster.helpers import apply, gpu_pod_manifest, metrics_base, wait_pods
from tests.polling import eventually

pytestmark = [pytest.mark.timeout(240)]
PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
UNPREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
Values = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def test_status_codes_are_spelled_as_go_spells_them() -> None:
    assert [
        go_code(c)
        for c in (
            grpc.StatusCode.OK,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.UNAVAILABLE,
        )
    ] == ["OK", "Canceled", "DeadlineExceeded", "Unavailable"]


async def test_a_pod_started_and_deleted_shows_in_the_kubelets_dra_metrics(tmp_path: Path) -> None:
    cfg = ClusterConfig(
        nodes=1,
        gpus="h100x1",
        data_dir=str(tmp_path / "data"),
        start_timeout=120,
        compute_domains=False,
        dashboard=False,
        metrics_port=metrics_base(),
    )
    async with LocalCluster(cfg) as cluster, aiohttp.ClientSession() as http:
        api = await cluster.api_client()
        spec = tmp_path / "worker.yaml"
        spec.write_text(gpu_pod_manifest("kubelet-metrics", "worker"))
        await apply(api, spec)
        await wait_pods(api, "kubelet-metrics", 1, timeout=90)

        async def values() -> Values:
            url = f"http://127.0.0.1:{cluster.metrics_ports['gpu-node-0-kubelet']}/metrics"
            async with http.get(url) as resp:
                text = await resp.text()
            return {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
            }

        def count(found: Values, name: str, **labels: str) -> float:
            return found.get((name, tuple(sorted(labels.items()))), 0.0)

        wait = functools.partial(eventually, timeout=60.0, every=0.2)
        found = await values()
        assert (
            count(found, "dra_operations_duration_seconds_count", operation_name="PrepareResources", is_error="false")
            == 1
        )
        assert (
            count(
                found,
                "dra_grpc_operations_duration_seconds_count",
                driver_name="gpu.nvidia.com",
                method_name=PREPARE,
                grpc_status_code="OK",
            )
            == 1
        )
        assert count(found, "dra_resource_claims_in_use", driver_name="gpu.nvidia.com") == 1
        assert count(found, "dra_resource_claims_in_use", driver_name="<any>") == 1

        await client.CoreV1Api(api).delete_namespaced_pod("worker", "kubelet-metrics")

        async def released() -> Values | None:
            # The claim leaves the node's prepared claims before the operation ends (its checkpoint is saved inside
            # it), as in the kubelet: a scrape between the two sees no claim and no UnprepareResources yet.
            found = await values()
            unprepares = sum(
                count(found, "dra_operations_duration_seconds_count", operation_name="UnprepareResources", is_error=e)
                for e in ("false", "true")
            )
            return found if unprepares else None

        found = await wait(released, "the pod's claims unprepared")
        assert count(found, "dra_resource_claims_in_use", driver_name="<any>") == 0
        assert (
            count(found, "dra_operations_duration_seconds_count", operation_name="UnprepareResources", is_error="false")
            == 1
        )
        assert (
            count(
                found,
                "dra_grpc_operations_duration_seconds_count",
                driver_name="gpu.nvidia.com",
                method_name=UNPREPARE,
                grpc_status_code="OK",
            )
            == 1
        )
        assert (
            count(found, "dra_operations_duration_seconds_count", operation_name="PrepareResources", is_error="true")
            == 0
        )
