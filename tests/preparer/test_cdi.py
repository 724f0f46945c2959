"""Generated CDI specs validate against the CDI JSON schema and the loader's own rules (CDI SPEC §6.2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services.discovery.testing import RunningDiscovery
from services.preparer.cdi import CdiDevice, DeviceNode, build_spec
from shared.bus import Bus
from tests.preparer.helpers import MemoryClaims, claim_doc, gpu_config, running_node

SCHEMA_DIR = Path(__file__).resolve().parents[3] / "shared" / "reference" / "cdi-schema"
_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
KNOWN_VERSIONS = {"0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"}


@pytest.fixture(scope="module")
def validator():
    if not SCHEMA_DIR.is_dir():
        pytest.skip(f"CDI schema folder {SCHEMA_DIR} is absent (it ships with the shared reference material)")
    from jsonschema import Draft7Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=DRAFT7))
    return Draft7Validator(schema, registry=registry)


def loader_errors(spec: dict) -> list[str]:
    """What the Go CDI loader checks beyond the schema (6.2)."""
    errors = []
    if spec.get("cdiVersion") not in KNOWN_VERSIONS:
        errors.append(f"cdiVersion {spec.get('cdiVersion')}")
    vendor, _, cls = spec.get("kind", "").partition("/")
    if not (_VENDOR_OR_CLASS.match(vendor) and _VENDOR_OR_CLASS.match(cls)):
        errors.append(f"kind {spec.get('kind')}")
    names = [d["name"] for d in spec.get("devices", [])]
    if not names or len(names) != len(set(names)):
        errors.append("device names missing or duplicated")
    edits_list = [spec.get("containerEdits", {})] + [d.get("containerEdits") for d in spec.get("devices", [])]
    for name in names:
        if not _DEVICE.match(name):
            errors.append(f"device name {name}")
    for dev in spec.get("devices", []):
        if not dev.get("containerEdits"):
            errors.append(f"device {dev['name']} has empty edits")
    for edits in edits_list:
        for env in (edits or {}).get("env", []):
            if env.find("=") <= 0:
                errors.append(f"env {env}")
        for node in (edits or {}).get("deviceNodes", []):
            if not node.get("path") or node.get("type", "") not in ("", "b", "c", "u", "p"):
                errors.append(f"deviceNode {node}")
        for mount in (edits or {}).get("mounts", []):
            if not mount.get("hostPath") or not mount.get("containerPath"):
                errors.append(f"mount {mount}")
    return errors


def test_the_validators_catch_a_broken_spec(validator) -> None:
    broken = {"cdiVersion": "0.5.0", "kind": "k8s.gpu.nvidia.com/claim",
              "devices": [{"name": "x", "containerEdits": {"deviceNodes": [{"hostPath": "/dev/nvidia0"}]}}]}
    assert list(validator.iter_errors(broken))
    assert loader_errors({"cdiVersion": "2.0", "kind": "nokind", "devices": [{"name": "-x-", "containerEdits": {}}]})


def test_a_built_spec_is_valid(validator) -> None:
    spec = build_spec("0f8a-uid", [CdiDevice("gpu-0", [DeviceNode("/dev/nvidia0", "/dev/nvidia0")])],
                      [DeviceNode("/dev/nvidiactl", "/dev/nvidiactl")])
    assert list(validator.iter_errors(spec)) == []
    assert loader_errors(spec) == []


async def test_prepared_specs_for_gpu_mig_and_mps_validate(validator, claims: MemoryClaims, root: Path, bus: Bus,
                                                           discovery: RunningDiscovery) -> None:
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
