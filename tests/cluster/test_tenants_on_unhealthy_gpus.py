"""Which tenant's pods run on unhealthy GPUs, answered from the metrics alone as an SRE's query would: on a local
cluster, two tenants' pods each hold a GPU; an XID 79 is injected on one; discovery's and the dashboard's real
/metrics are scraped, parsed with prometheus_client's parser and joined by UUID as
`gpu_dra_device_allocation_info * on(UUID) group_left (1 - gpu_dra_device_healthy) > 0`."""

from __future__ import annotations

import functools
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from embedded.cluster.local import ClusterConfig, LocalCluster
from tests.cluster.helpers import apply, edits, gpu_pod_manifest, inject_xid, metrics_base, wait_pods
from tests.polling import eventually

pytestmark = [pytest.mark.timeout(240)]
TENANTS = {"team-a": "trainer", "team-b": "evaluator"}


def samples(text: str, name: str) -> list[Sample]:
    return [s for f in text_string_to_metric_families(text) if f.name == name for s in f.samples]


def on_unhealthy_gpus(allocation: list[Sample], health: list[Sample]) -> set[tuple[str, str, str]]:
    """`gpu_dra_device_allocation_info * on(UUID) group_left (1 - gpu_dra_device_healthy) > 0`, as
    (namespace, pod, container): many allocation series to one health series per UUID, the left's labels kept."""
    unhealth: dict[str, float] = {}
    for s in health:
        assert s.labels["UUID"] not in unhealth, f"two health series for {s.labels['UUID']}: PromQL would refuse"
        unhealth[s.labels["UUID"]] = 1 - s.value
    joined = [(s.labels, s.value * unhealth[s.labels["UUID"]]) for s in allocation if s.labels["UUID"] in unhealth]
    return {(labels["namespace"], labels["pod"], labels["container"]) for labels, value in joined if value > 0}


async def test_the_join_of_allocation_and_health_names_the_pod_on_the_failed_gpu(tmp_path: Path) -> None:
    cfg = ClusterConfig(
        nodes=1,
        gpus="h100x2",
        data_dir=str(tmp_path / "data"),
        start_timeout=120,
        compute_domains=False,
        metrics_port=metrics_base(),
    )
    async with LocalCluster(cfg) as cluster, aiohttp.ClientSession() as http:
        api = await cluster.api_client()
        for ns, pod in TENANTS.items():
            spec = tmp_path / f"{ns}.yaml"
            spec.write_text(gpu_pod_manifest(ns, pod, container="train", sidecar="sidecar"))
            await apply(api, spec)
        (trainer,) = await wait_pods(api, "team-a", 1, timeout=90)
        await wait_pods(api, "team-b", 1, timeout=90)

        async def scrape(service: str, name: str) -> list[Sample]:
            url = f"http://127.0.0.1:{cluster.metrics_ports[service]}/metrics"
            try:
                async with http.get(url) as resp:
                    return samples(await resp.text(), name)
            except aiohttp.ClientConnectionError:  # the service may still be binding its port
                return []

        wait = functools.partial(eventually, timeout=60.0, every=0.2)

        async def both_pods_mapped() -> list[Sample]:
            found = await scrape("dashboard", "gpu_dra_device_allocation_info")
            return found if {s.labels["pod"] for s in found} == set(TENANTS.values()) else []

        allocation = await wait(both_pods_mapped, "both pods in the dashboard's allocation series")
        assert {
            (s.labels["namespace"], s.labels["pod"], s.labels["container"], s.labels["Hostname"]) for s in allocation
        } == {("team-a", "trainer", "train", "gpu-node-0"), ("team-b", "evaluator", "train", "gpu-node-0")}
        health = await wait(lambda: scrape("gpu-node-0-discovery", "gpu_dra_device_healthy"), "health series")
        assert on_unhealthy_gpus(allocation, health) == set()

        (device,) = edits(trainer)["train"]["devices"]
        await inject_xid(cluster.nats_env(), "gpu-node-0", device.split("/")[1], 79)

        async def unhealthy() -> list[Sample]:
            found = await scrape("gpu-node-0-discovery", "gpu_dra_device_healthy")
            return found if any(s.value == 0 for s in found) else []

        health = await wait(unhealthy, "the injected GPU unhealthy in discovery's metrics")
        allocation = await scrape("dashboard", "gpu_dra_device_allocation_info")
        assert on_unhealthy_gpus(allocation, health) == {("team-a", "trainer", "train")}
        (bad,) = [s.labels["UUID"] for s in health if s.value == 0]
        assert [s.labels["UUID"] for s in allocation if s.labels["pod"] == "trainer"] == [bad]
