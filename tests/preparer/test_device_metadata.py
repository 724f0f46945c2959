"""Device metadata files (KEP-5304) through the preparer's real sockets, discovery in-process on simulated H100s.

Per prepared claim request, a `metadata.resource.k8s.io/v1alpha1` DeviceMetadata file under the plugin dir,
mounted read-only by the claim's CDI spec at the well-known container path and named by
GPU_DRA_DEVICE_METADATA_FILE; checked for a full GPU, a dynamic MIG device, a share and a VFIO passthrough GPU
(PCI bus id, IOMMU group), against the schema `gpu-dra events schema` exports; removed on unprepare, swept at
start, and absent while the DeviceMetadata gate is off (its default).
"""

from __future__ import annotations

import json
import uuid as uuidlib
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from embedded.harness.discovery import RunningDiscovery
from embedded.kubelet.client import Claim
from services.discovery import simpci
from services.preparer.gpu.pcisysfs import PciSysfs, normal_bdf
from shared.bus import Bus
from shared.events import devicemetadata as dm
from shared.events.schema import write_schemas
from tests.preparer.helpers import DRIVER, MemoryClaims, Node, claim_doc, running_node

ON = "DeviceMetadata=true"

VFIO_CONFIG = {
    "source": "FromClaim",
    "requests": ["vm"],
    "opaque": {
        "driver": DRIVER,
        "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig"},
    },
}


@pytest.fixture
def schema(tmp_path: Path) -> dict[str, Any]:
    index = write_schemas(tmp_path)
    (entry,) = [f for f in index["files"] if f["name"] == "device-metadata"]
    assert (
        entry["path"] == "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/"
        "<driver>-metadata.json"
    )
    return dict(json.loads((tmp_path / entry["schema"]).read_text()))


def metadata_root(node: Node) -> Path:
    return Path(node.cfg.plugins_dir) / DRIVER / "device-metadata"


def files_of(node: Node, uid: str) -> list[str]:
    """The metadata files on the host of the claim `uid` ("": of any claim)."""
    root = metadata_root(node)
    return sorted(p.name for p in root.iterdir() if p.name.startswith(uid)) if root.exists() else []


async def prepared(node: Node, claims: MemoryClaims, doc: dict[str, Any]) -> tuple[Claim, dict[str, Any]]:
    """Prepare `doc` through the kubelet emulator; the claim and its CDI spec."""
    claim = claims.add(doc)
    result = (await node.plugin.prepare([claim]))[claim.uid]
    assert result.error == "", result.error
    spec = json.loads((node.cdi_dir / f"k8s.gpu.nvidia.com-claim_{claim.uid}.json").read_text())
    return claim, spec


def mounted(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Container path -> the file's first (v1alpha1) object, for each metadata mount of the spec's devices; each
    mount read-only, named by the env var, and valid under the exported schema."""
    out: dict[str, dict[str, Any]] = {}
    for dev in spec["devices"]:
        edits = dev["containerEdits"]
        mounts = [m for m in edits.get("mounts") or [] if m["containerPath"].startswith(dm.CONTAINER_ROOT)]
        assert mounts, edits
        env = dict(e.split("=", 1) for e in edits["env"])
        assert env[dm.ENV] == mounts[0]["containerPath"]
        for m in mounts:
            assert "ro" in m["options"] and "rw" not in m["options"], m
            text = Path(m["hostPath"]).read_text()
            assert text.endswith("\n") and text.count("\n") == 1  # a stream of one object: one version
            doc = json.loads(text)
            jsonschema.validate(doc, schema)
            assert dm.decode(text.encode()).metadata.uid == doc["metadata"]["uid"]
            out[m["containerPath"]] = doc
    return out


def attrs(device: dict[str, Any]) -> dict[str, Any]:
    return {k: next(iter(v.values())) for k, v in device["attributes"].items()}


def gpu_of(discovery: RunningDiscovery, name: str) -> Any:
    return next(g for g in discovery.inventory.gpus if g.name == name)


async def test_full_gpu_and_mig_device_files_name_their_devices_and_go_on_unprepare(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery, schema: dict[str, Any]
) -> None:
    strays = root / "plugins" / DRIVER / "device-metadata"
    strays.mkdir(parents=True)
    (strays / f"{uuidlib.uuid4()}_gpu.json").write_text("{}\n")  # a claim's whose record a crash lost
    (strays / f".{uuidlib.uuid4()}_gpu.json.77.tmp").write_text("{")  # a write a crash cut short
    async with running_node(claims, root, bus=bus, feature_gates=ON) as node:
        assert files_of(node, "") == [], "swept at start: the checkpoint holds no such claim"
        doc = claim_doc(name="train", results=[("gpu", "gpu-0"), ("gpu", "gpu-1"), ("mig", "gpu-2-mig-1g10gb-19-3")])
        claim, spec = await prepared(node, claims, doc)
        files = mounted(spec, schema)
        assert files_of(node, claim.uid) == [f"{claim.uid}_gpu.json", f"{claim.uid}_mig.json"]
        base = f"{dm.CONTAINER_ROOT}/resourceclaims/train"
        assert set(files) == {f"{base}/gpu/{DRIVER}-metadata.json", f"{base}/mig/{DRIVER}-metadata.json"}
        gpus = files[f"{base}/gpu/{DRIVER}-metadata.json"]
        assert (gpus["apiVersion"], gpus["kind"]) == ("metadata.resource.k8s.io/v1alpha1", "DeviceMetadata")
        assert gpus["metadata"] == {"name": "train", "namespace": "default", "uid": claim.uid, "generation": 1}
        assert "podClaimName" not in gpus
        (request,) = gpus["requests"]
        assert request["name"] == "gpu" and [d["name"] for d in request["devices"]] == ["gpu-0", "gpu-1"]
        for device in request["devices"]:
            gpu = gpu_of(discovery, device["name"])
            assert (device["driver"], device["pool"]) == (DRIVER, "n1")
            assert attrs(device) == {
                "type": "gpu",
                "uuid": gpu.uuid,
                "productName": gpu.product_name,
                "resource.kubernetes.io/pciBusID": normal_bdf(gpu.pci_bus_id),
                **({"numaNode": gpu.numa_node} if gpu.numa_node >= 0 else {}),
            }
        (mig,) = files[f"{base}/mig/{DRIVER}-metadata.json"]["requests"][0]["devices"]
        parent = gpu_of(discovery, "gpu-2")
        created = next(m for m in gpu_of(discovery, "gpu-2").mig_devices if m.name == "gpu-2-mig-1g10gb-19-3")
        got = attrs(mig)
        assert (got["type"], got["uuid"], got["parentUUID"]) == ("mig", created.uuid, parent.uuid)
        assert got["uuid"].startswith("MIG-") and got["resource.kubernetes.io/pciBusID"] == normal_bdf(
            parent.pci_bus_id
        )

        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert files_of(node, claim.uid) == []


async def test_share_and_template_claim_files(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery, schema: dict[str, Any]
) -> None:
    async with running_node(claims, root, bus=bus, feature_gates=ON) as node:
        doc = claim_doc(name="pod1-gpu-x7k2q", results=[("gpu", "gpu-3")])
        doc["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "shared-gpu"}
        result = doc["status"]["allocation"]["devices"]["results"][0]
        share_id = result["shareID"] = str(uuidlib.uuid4())
        result["consumedCapacity"] = {"memory": "10Gi"}
        claim, spec = await prepared(node, claims, doc)
        files = mounted(spec, schema)
        path = f"{dm.CONTAINER_ROOT}/resourceclaimtemplates/shared-gpu/gpu/{DRIVER}-metadata.json"
        assert list(files) == [path]
        assert files[path]["podClaimName"] == "shared-gpu"
        assert files[path]["metadata"]["name"] == "pod1-gpu-x7k2q"
        (device,) = files[path]["requests"][0]["devices"]
        assert (attrs(device)["shareID"], attrs(device)["uuid"]) == (share_id, gpu_of(discovery, "gpu-3").uuid)
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert files_of(node, claim.uid) == []


async def test_vfio_file_names_pci_bus_id_and_iommu_group(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery, schema: dict[str, Any]
) -> None:
    node_root = root / "sim" / "n1"
    simpci.serve(node_root)
    (root / "proc").mkdir()
    sysfs = PciSysfs(node_root)
    async with running_node(
        claims,
        root,
        bus=bus,
        sys_root=str(node_root),
        proc_root=str(root),
        feature_gates=ON + ",PassthroughSupport=true",
    ) as node:
        claim, spec = await prepared(
            node, claims, claim_doc(name="vm", results=[("vm", "gpu-vfio-1")], configs=[VFIO_CONFIG])
        )
        gpu = gpu_of(discovery, "gpu-1")
        bdf = normal_bdf(gpu.pci_bus_id)
        assert sysfs.driver_of(bdf) == "vfio-pci"
        (doc,) = mounted(spec, schema).values()
        (device,) = doc["requests"][0]["devices"]
        assert attrs(device)["resource.kubernetes.io/pciBusID"] == bdf
        assert attrs(device)["iommuGroup"] == sysfs.iommu_group(bdf)
        assert (attrs(device)["type"], attrs(device)["uuid"]) == ("vfio", gpu.uuid)
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert sysfs.driver_of(bdf) == "nvidia"
        assert files_of(node, claim.uid) == []


async def test_with_the_gate_off_no_file_is_written_or_mounted(
    claims: MemoryClaims, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    async with running_node(claims, root, bus=bus) as node:
        claim, spec = await prepared(node, claims, claim_doc(name="plain", results=[("gpu", "gpu-4")]))
        (dev,) = spec["devices"]
        assert "mounts" not in dev["containerEdits"]
        assert not any(e.startswith(dm.ENV) for e in dev["containerEdits"].get("env") or [])
        assert not metadata_root(node).exists()
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
