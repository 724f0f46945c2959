"""A NodeConfig rule that time-slices a node pool's GPUs, applied by the preparer when it prepares a claim:
the in-process preparer reads the shipped CRD's objects and its Node's labels from the embedded API server;
discovery runs the fake driver root's nvidia-smi on simulated H100s over a real nats-server. The interval
reaches the GPU (and is reset after the claim); a claim's own TimeSlicing config keeps its interval; an MPS
config on such a GPU is refused with nothing changed; a changed rule or a relabelled node applies to the
next prepare, never to a claim already prepared."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml

from embedded.harness.discovery import RunningDiscovery
from services.preparer.host.claims import KubeClaimSource
from services.preparer.nodesettings import KubeNodeSettings
from shared.kube import rest as kube
from shared.natsserver import EmbeddedNats
from tests.fakedriver import FakeDriver
from tests.preparer.helpers import ApiClaims, claim_doc, gpu_config, running_node
from tests.preparer.test_crash_sharing import node_parts

CRD = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base" / "crds" / "nodeconfigs.yaml"
NODECONFIGS = "/apis/resource.nvidia.com/v1beta1/nodeconfigs"
TIMESLICE = {"Default": "0", "Short": "1", "Medium": "2", "Long": "3"}


def pool_rule(interval: str, pool: str = "inference") -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "NodeConfig",
        "metadata": {"name": "pools"},
        "spec": {
            "rules": [
                {
                    "name": pool,
                    "nodeSelector": {"matchLabels": {"pool": pool}},
                    "sharing": "timeSlicing",
                    "timeSliceInterval": interval,
                }
            ]
        },
    }


@contextlib.asynccontextmanager
async def settings_of(client: Any) -> AsyncIterator[KubeNodeSettings]:
    settings = KubeNodeSettings(client, "n1")
    stopping = asyncio.Event()
    task = asyncio.create_task(settings.run(stopping))
    try:
        await settings.synced()
        yield settings
    finally:
        stopping.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(settings: KubeNodeSettings, check: Any) -> None:
    """Until the settings' informers have delivered what `check` looks for (each change wakes the wait)."""
    changed = asyncio.Event()
    settings.node.on_change = lambda *_: changed.set()
    assert settings.objects is not None
    settings.objects.informer.on_change = _chain(settings.objects.informer.on_change, changed.set)
    async with asyncio.timeout(10):
        while not check():
            await changed.wait()
            changed.clear()


def _chain(first: Any, then: Any) -> Any:
    def both(*args: Any) -> None:
        first(*args)
        then()

    return both


async def test_a_pools_rule_time_slices_its_gpus_from_the_next_prepare_on(
    root: Path, nats_server: EmbeddedNats
) -> None:
    async with node_parts(root, nats_server) as (bus, _api, claims, disc, fake):
        client = claims.client
        await kube.request(
            client,
            "POST",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            body=yaml.safe_load(CRD.read_text()),
        )
        await kube.request(
            client, "POST", "/api/v1/nodes", body={"metadata": {"name": "n1", "labels": {"pool": "inference"}}}
        )
        await kube.request(client, "POST", NODECONFIGS, body=pool_rule("Short"))
        uuids = {g.name: g.uuid for g in disc.inventory.gpus}
        async with (
            settings_of(client) as settings,
            running_node(KubeClaimSource(client), root, bus=bus, settings=settings) as node,
        ):
            await _check_modes(node, claims, fake, disc, uuids)
            await _check_changes(node, claims, fake, settings, uuids)


async def _check_modes(
    node: Any, claims: ApiClaims, fake: FakeDriver, disc: RunningDiscovery, uuids: dict[str, str]
) -> None:
    plain = await claims.add(claim_doc(name="plain", results=[("gpu", "gpu-0")]))
    assert (await node.plugin.prepare([plain]))[plain.uid].error == ""
    assert fake.timeslice(uuids["gpu-0"]) == TIMESLICE["Short"]
    [held] = node.service.checkpoint.claims[plain.uid].devices
    assert held.sharing == "TimeSlicing" and not held.shared, "time-sliced, and still one claim's"

    own = await claims.add(
        claim_doc(
            name="own",
            results=[("gpu", "gpu-1")],
            configs=[gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})],
        )
    )
    assert (await node.plugin.prepare([own]))[own.uid].error == ""
    assert fake.timeslice(uuids["gpu-1"]) == TIMESLICE["Long"], "the claim's own interval"
    assert await node.plugin.unprepare([own]) == {own.uid: ""}
    assert fake.timeslice(uuids["gpu-1"]) == "0"

    calls = len(fake.calls("nvidia-smi"))
    mps = await claims.add(claim_doc(name="mps", results=[("gpu", "gpu-1")], configs=[gpu_config({"strategy": "MPS"})]))
    error = (await node.plugin.prepare([mps]))[mps.uid].error
    assert "time-sliced by NodeConfig rule pools/inference" in error and "MPS" in error, error
    assert mps.uid not in node.service.checkpoint.claims and len(fake.calls("nvidia-smi")) == calls
    assert fake.calls("nvidia-cuda-mps-control") == [] and node.cdi_files() == [
        f"k8s.gpu.nvidia.com-claim_{plain.uid}.json"
    ]

    assert await node.plugin.unprepare([plain]) == {plain.uid: ""}
    assert fake.timeslice(uuids["gpu-0"]) == "0", "reset after the claim"
    assert next(g for g in disc.inventory.gpus if g.name == "gpu-0").sharing.timeslice in ("Default", "Short")


async def _check_changes(
    node: Any, claims: ApiClaims, fake: FakeDriver, settings: KubeNodeSettings, uuids: dict[str, str]
) -> None:
    first = await claims.add(claim_doc(name="first", results=[("gpu", "gpu-0")]))
    assert (await node.plugin.prepare([first]))[first.uid].error == ""
    assert fake.timeslice(uuids["gpu-0"]) == TIMESLICE["Short"]

    stored = json.loads(await kube.request(claims.client, "GET", f"{NODECONFIGS}/pools"))
    stored["spec"] = pool_rule("Medium")["spec"]
    await kube.request(claims.client, "PUT", f"{NODECONFIGS}/pools", body=stored)
    await until(settings, lambda: settings.setting(_gpu(node, "gpu-1")).time_slice_interval == "Medium")
    assert fake.timeslice(uuids["gpu-0"]) == TIMESLICE["Short"], "a prepared claim is never touched"
    second = await claims.add(claim_doc(name="second", results=[("gpu", "gpu-1")]))
    assert (await node.plugin.prepare([second]))[second.uid].error == ""
    assert fake.timeslice(uuids["gpu-1"]) == TIMESLICE["Medium"], "the next prepare has the new interval"
    assert await node.plugin.unprepare([first, second]) == {first.uid: "", second.uid: ""}

    await kube.request(
        claims.client,
        "PATCH",
        "/api/v1/nodes/n1",
        body={"metadata": {"labels": {"pool": "train"}}},
        content_type="application/merge-patch+json",
    )
    await until(settings, lambda: settings.labels.get("pool") == "train")
    calls = len(fake.calls("nvidia-smi"))
    third = await claims.add(claim_doc(name="third", results=[("gpu", "gpu-0")]))
    assert (await node.plugin.prepare([third]))[third.uid].error == ""
    [held] = node.service.checkpoint.claims[third.uid].devices
    assert held.sharing == "" and len(fake.calls("nvidia-smi")) == calls, "out of the pool: exclusive, untouched"
    assert await node.plugin.unprepare([third]) == {third.uid: ""}


def _gpu(node: Any, name: str) -> Any:
    return next(g for g in node.service.plugin.inventory.current.gpus if g.name == name)
