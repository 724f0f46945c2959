"""Inputs cannot stall a node: a hostile tenant's opaque config fails fast with its own clear error while
a neighbour's claim on the same node prepares normally, and no reply names another tenant's claim.

A real preparer on its real unix sockets, called by the kubelet emulator; discovery simulated in-process
over a real nats-server (so the preparer knows each GPU's memory); claims served as JSON bytes through
the same decoder the Kubernetes claim source uses.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from embedded.harness.discovery import RunningDiscovery
from embedded.kubelet.client import Claim
from services.preparer.host.claims import (
    ClaimDecodeError,
    ClaimFetchError,
    ClaimNotFound,
    ResourceClaim,
    decode_claim,
)
from shared.bus import Bus
from tests.preparer.helpers import claim_doc, gpu_config, running_node

BOUND_S = 1.0


class JsonClaims:
    """A ClaimSource serving claims as JSON bytes through `decode_claim`, as the API server's reply is decoded."""

    def __init__(self) -> None:
        self.bodies: dict[tuple[str, str], bytes] = {}
        self.gates: dict[tuple[str, str], asyncio.Event] = {}

    def add(
        self,
        doc: dict[str, Any] | None = None,
        *,
        body: bytes = b"",
        namespace: str = "",
        name: str = "",
        uid: str = "",
    ) -> Claim:
        if doc is not None:
            meta = doc["metadata"]
            namespace, name, uid, body = meta["namespace"], meta["name"], meta["uid"], json.dumps(doc).encode()
        self.bodies[(namespace, name)] = body
        return Claim(namespace=namespace, uid=uid, name=name)

    async def get(self, namespace: str, name: str) -> ResourceClaim:
        gate = self.gates.get((namespace, name))
        if gate is not None:
            await gate.wait()  # a claim whose fetch hangs (an API server that does not answer for it)
        body = self.bodies.get((namespace, name))
        if body is None:
            raise ClaimNotFound(f"ResourceClaim {namespace}/{name} not found")
        try:
            return decode_claim(body)
        except ClaimDecodeError as exc:
            raise ClaimFetchError(f"ResourceClaim {namespace}/{name} did not decode: {exc}") from exc


def mps(**mps_config: Any) -> dict[str, Any]:
    return gpu_config({"strategy": "MPS", "mpsConfig": mps_config})


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def hostile_doc(config: dict[str, Any]) -> dict[str, Any]:
    return claim_doc(name="evil", namespace="tenant-a", results=[("gpu", "gpu-0")], configs=[config])


def neighbour_doc() -> dict[str, Any]:
    return claim_doc(
        name="good",
        namespace="tenant-b",
        results=[("gpu", "gpu-1")],
        configs=[mps(defaultActiveThreadPercentage=50, defaultPinnedDeviceMemoryLimit="10Gi")],
    )


def assert_not_named(text: str, claim: Claim) -> None:
    for part in (claim.uid, claim.name, claim.namespace):
        assert part not in text, f"{part!r} of another tenant's claim leaks into {text!r}"


HOSTILE = {
    "huge exponent": (mps(defaultPinnedDeviceMemoryLimit="1e999999"), "exponent 999999 is out of range"),
    "exponent with a suffix": (mps(defaultPinnedDeviceMemoryLimit="1e30Gi"), "'1e30Gi' is not a quantity"),
    "beyond 2^63-1": (mps(defaultPinnedDeviceMemoryLimit="1e30"), "too large: at most 9223372036854775807"),
    "more than the GPU's memory": (
        mps(defaultPerDevicePinnedMemoryLimit={"0": "81Gi"}),
        "more than the 85899345920 allowed",
    ),
    "a 1 MB quantity": (mps(defaultPinnedDeviceMemoryLimit="9" * 1_000_000), "more than the 10240 allowed"),
    "thread percentage": (mps(defaultActiveThreadPercentage=10**30), "within 0..100, got a larger number"),
    "interval name": (
        gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}),
        'field "sharing.timeSlicingConfig.interval" must be one of Default, Short, Medium, Long',
    ),
    "a long unknown field": (gpu_config({"strategy": "TimeSlicing", "x" * 5000: 1}), 'unknown field "sharing.xxxx'),
    "a long strategy": (gpu_config({"strategy": "S" * 5000}), "unknown GPU sharing strategy: 'SSSS"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_a_hostile_config_fails_fast_and_the_neighbour_prepares(
    case: str, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    config, message = HOSTILE[case]
    assert next(g for g in discovery.inventory.gpus if g.name == "gpu-0").memory_bytes == 80 * 2**30
    claims = JsonClaims()
    evil = claims.add(hostile_doc(config))
    good = claims.add(neighbour_doc())
    async with running_node(claims, root, bus=bus) as node:
        start = time.perf_counter()
        results = await node.plugin.prepare([evil, good])  # one kubelet batch, both tenants
        elapsed = time.perf_counter() - start
        assert elapsed < BOUND_S, f"the batch took {elapsed:.2f} s"
        assert message in results[evil.uid].error
        assert results[evil.uid].error.startswith(f"error preparing devices for claim tenant-a/evil:{evil.uid}: ")
        assert len(results[evil.uid].error) < 1024  # the kubelet's message limit: an input is never echoed whole
        assert results[good.uid].error == "" and [d.device for d in results[good.uid].devices] == ["gpu-1"]
        assert_not_named(json.dumps(results[good.uid].__dict__, default=vars), evil)
        assert evil.uid not in node.service.checkpoint.claims  # the bad claim changed nothing
        assert node.cdi_files() == [f"k8s.gpu.nvidia.com-claim_{good.uid}.json"]


async def test_a_claim_body_nested_past_the_decoder_limit_fails_fast(
    root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    claims = JsonClaims()
    doc = hostile_doc(gpu_config())
    body = json.dumps(doc).encode().replace(b'"kind": "GpuConfig"', b'"kind": "GpuConfig", "x": ' + nested(200_000))
    evil = claims.add(body=body, namespace="tenant-a", name="evil", uid=doc["metadata"]["uid"])
    too_big = claims.add(body=b" " * (4 * 1024 * 1024), namespace="tenant-a", name="big", uid="u-big")
    good = claims.add(neighbour_doc())
    async with running_node(claims, root, bus=bus) as node:
        start = time.perf_counter()
        results = await node.plugin.prepare([evil, too_big, good])
        assert time.perf_counter() - start < BOUND_S
        assert "did not decode: the body nests too deeply" in results[evil.uid].error
        assert "more than the 3145728 a claim may have" in results[too_big.uid].error
        assert results[good.uid].error == ""


async def test_a_claim_whose_fetch_hangs_does_not_delay_another_claims_prepare(
    root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    claims = JsonClaims()
    stuck = claims.add(hostile_doc(gpu_config()))
    good = claims.add(neighbour_doc())
    claims.gates[("tenant-a", "evil")] = gate = asyncio.Event()
    async with running_node(claims, root, bus=bus) as node:
        pending = asyncio.create_task(node.plugin.prepare([stuck]))
        start = time.perf_counter()
        results = await node.plugin.prepare([good])  # a second kubelet call while the first hangs
        assert time.perf_counter() - start < BOUND_S
        assert results[good.uid].error == ""
        assert not pending.done()
        gate.set()
        assert (await pending)[stuck.uid].error == ""


async def test_a_device_held_by_another_tenant_is_refused_without_naming_the_holder(
    root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    claims = JsonClaims()
    holder = claims.add(claim_doc(name="holder", namespace="tenant-a", results=[("gpu", "gpu-0")]))
    second = claims.add(claim_doc(name="second", namespace="tenant-b", results=[("gpu", "gpu-0")]))
    async with running_node(claims, root, bus=bus) as node:
        assert (await node.plugin.prepare([holder]))[holder.uid].error == ""
        refused = (await node.plugin.prepare([second]))[second.uid]
        assert "gpu-0 is already allocated to a different claim on this node" in refused.error
        assert "tenant-b/second" in refused.error  # its own claim, named
        assert_not_named(refused.error, holder)
