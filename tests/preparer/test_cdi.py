"""Generated CDI specs validate against the CDI JSON schema and the loader's own rules (CDI SPEC §6.2)."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from embedded.harness.discovery import RunningDiscovery
from services.preparer.host.cdi import CdiDevice, CdiError, CdiWriter, ContainerEdits, DeviceNode, build_spec
from shared.bus import Bus
from tests.preparer.cdischema import cdi_validator, loader_errors
from tests.preparer.helpers import MemoryClaims, claim_doc, gpu_config, running_node


@pytest.fixture(scope="module")
def validator():
    return cdi_validator()


def test_the_validators_catch_a_broken_spec(validator) -> None:
    broken = {
        "cdiVersion": "0.5.0",
        "kind": "k8s.gpu.nvidia.com/claim",
        "devices": [{"name": "x", "containerEdits": {"deviceNodes": [{"hostPath": "/dev/nvidia0"}]}}],
    }
    assert list(validator.iter_errors(broken))
    assert loader_errors({"cdiVersion": "2.0", "kind": "nokind", "devices": [{"name": "-x-", "containerEdits": {}}]})


def test_a_built_spec_is_valid(validator) -> None:
    spec = build_spec(
        "0f8a-uid",
        [CdiDevice("gpu-0", [DeviceNode("/dev/nvidia0", "/dev/nvidia0")])],
        ContainerEdits(nodes=[DeviceNode("/dev/nvidiactl", "/dev/nvidiactl")]),
    )
    assert list(validator.iter_errors(spec)) == []
    assert loader_errors(spec) == []


@pytest.mark.parametrize("device", ["gpu-0-", "gpu 0", "gpu-0\n", ""])  # each named `<claim uid>-<device>`
def test_a_device_name_cdi_refuses_is_refused_before_any_spec_is_built(device: str) -> None:
    with pytest.raises(CdiError, match="is not valid"):
        build_spec("0f8a-uid", [CdiDevice(device, [DeviceNode("/dev/nvidia0", "/dev/nvidia0")])], ContainerEdits())


async def test_prepared_specs_for_gpu_mig_and_mps_validate(
    validator, claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    docs = [
        claim_doc(name="full", results=[("gpu", "gpu-0"), ("gpu", "gpu-1")]),
        claim_doc(name="mig", results=[("mig", "gpu-2-mig-1g10gb-19-3")]),
        claim_doc(name="mps", results=[("gpu", "gpu-3")], configs=[gpu_config({"strategy": "MPS"})]),
    ]
    refs = [claims.add(d) for d in docs]
    async with running_node(claims, root, bus=bus) as node:
        results = await node.plugin.prepare(refs)
        assert all(r.error == "" for r in results.values()), results
        files = sorted(node.cdi_dir.glob("*.json"))
        assert len(files) == 3
        for path in files:
            spec = json.loads(path.read_text())
            assert [e.message for e in validator.iter_errors(spec)] == [], path.name
            assert loader_errors(spec) == [], path.name
        await node.plugin.unprepare(refs)
        assert list(node.cdi_dir.glob("*.json")) == []


@pytest.mark.parametrize("durable", [True, False])
async def test_a_claims_spec_name_is_not_interned(tmp_path: Path, durable: bool) -> None:
    """Per-claim spec names stay out of the interpreter's table of interned strings (pathlib interns each part
    of a path it parses): a name per claim there grows the table until it resizes, a ~1 MB step of RSS after
    some thousands of claims. Both ways a spec is written: a new file, and a spare left by a removed spec."""
    writer = CdiWriter(tmp_path, durable=durable)
    spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": []}
    uid = str(uuid.uuid4())
    first = await writer.write(uid, spec)
    assert await writer.remove(uid)
    second = await writer.write(str(uuid.uuid4()), spec)  # into the removed spec's spare, where not durable
    assert os.listdir(str(tmp_path)).count(second) == 1
    for name in (first, second):
        fresh = "".join(list(name))  # an equal string of its own: sys.intern returns it unless one is interned
        assert sys.intern(fresh) is fresh, f"{name} was interned"
