"""The plain full-GPU path over the real socket, with no NATS at all: prepare, idempotency, unprepare,
config errors, node and overlap checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from embedded.kubelet.client import cdi_ids_for
from shared.files import fsync_count
from tests.preparer.helpers import MemoryClaims, claim_doc, gpu_config, running_node


@pytest.fixture
def dev_root(root: Path) -> Path:
    dev = root / "host" / "dev"
    dev.mkdir(parents=True)
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        (dev / name).touch()
    return root / "host"


async def test_full_gpu_prepare_and_unprepare_without_nats(claims: MemoryClaims, root: Path, dev_root: Path) -> None:
    claim = claims.add(claim_doc(name="one", results=[("gpu", "gpu-1")]))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        result = (await node.plugin.prepare([claim]))[claim.uid]
        assert result.error == ""
        [dev] = result.devices
        assert (dev.request_names, dev.pool, dev.device) == (["gpu"], "n1", "gpu-1")
        assert dev.cdi_device_ids == [f"k8s.gpu.nvidia.com/claim={claim.uid}-gpu-1"]
        spec_file = node.cdi_dir / f"k8s.gpu.nvidia.com-claim_{claim.uid}.json"
        spec = json.loads(spec_file.read_text())
        assert spec["kind"] == "k8s.gpu.nvidia.com/claim"
        assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
        assert {
            "path": "/dev/nvidiactl",
            "hostPath": f"{dev_root}/dev/nvidiactl",
            "fileMode": 0o666,
            "permissions": "rwm",
        } in spec["containerEdits"]["deviceNodes"]
        [cdi_dev] = spec["devices"]
        assert cdi_dev["name"] == f"{claim.uid}-gpu-1"
        assert cdi_dev["containerEdits"]["deviceNodes"] == [
            {"path": "/dev/nvidia1", "hostPath": f"{dev_root}/dev/nvidia1"}
        ]
        record = node.service.checkpoint.claims[claim.uid]
        assert record.state == "PrepareCompleted" and (record.namespace, record.name) == ("default", "one")
        prepared = {"node": "n1", "driver": "gpu.nvidia.com", "device_type": "gpu"}
        assert REGISTRY.get_sample_value("gpu_dra_prepared_devices", prepared) == 1.0, "counted when scraped"

        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
        assert REGISTRY.get_sample_value("gpu_dra_prepared_devices", prepared) == 0.0
        assert not spec_file.exists()
        assert claim.uid not in node.service.checkpoint.claims
        on_disk = json.loads((root / "plugins" / "gpu.nvidia.com" / "checkpoint.json").read_text())
        assert on_disk["preparedClaims"] == {}
        assert [e.event for e in node.service.events.pending] == ["prepare-started", "prepared", "unprepared"]


async def test_several_devices_and_two_containers_sharing_one_claim(
    claims: MemoryClaims, root: Path, dev_root: Path
) -> None:
    claim = claims.add(
        claim_doc(name="multi", results=[("train", "gpu-0"), ("train", "gpu-2"), ("infer/small", "gpu-3")])
    )
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        result = (await node.plugin.prepare([claim]))[claim.uid]
        assert result.error == ""
        assert [(d.device, d.request_names) for d in result.devices] == [
            ("gpu-0", ["train"]),
            ("gpu-2", ["train"]),
            ("gpu-3", ["infer"]),
        ]
        # container A references request "train", container B request "infer" (the subrequest is stripped)
        assert cdi_ids_for(result, "train") == [
            f"k8s.gpu.nvidia.com/claim={claim.uid}-gpu-0",
            f"k8s.gpu.nvidia.com/claim={claim.uid}-gpu-2",
        ]
        assert cdi_ids_for(result, "infer") == [f"k8s.gpu.nvidia.com/claim={claim.uid}-gpu-3"]
        assert len(cdi_ids_for(result)) == 3
        specs = node.cdi_files()
        assert specs and len(json.loads((node.cdi_dir / specs[0]).read_text())["devices"]) == 3


async def test_repeated_prepare_returns_the_checkpointed_result_without_side_effects(
    claims: MemoryClaims, root: Path, dev_root: Path
) -> None:
    claim = claims.add(claim_doc(name="again", results=[("gpu", "gpu-0")]))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        first = (await node.plugin.prepare([claim]))[claim.uid]
        spec_file = node.cdi_dir / node.cdi_files()[0]
        spec_file.unlink()  # a side effect a repeat would redo
        claims.delete("default", "again")  # and a repeat must not even need the API server
        second = (await node.plugin.prepare([claim]))[claim.uid]
        assert second == first
        assert not spec_file.exists()
        assert [e.event for e in node.service.events.pending] == ["prepare-started", "prepared"]


async def test_unprepare_of_an_unknown_claim_succeeds(claims: MemoryClaims, root: Path) -> None:
    claim = claims.add(claim_doc(name="never", results=[("gpu", "gpu-0")]))
    async with running_node(claims, root) as node:
        assert await node.plugin.unprepare([claim]) == {claim.uid: ""}


async def test_unknown_config_field_is_a_per_claim_error_naming_it_and_writes_nothing(
    claims: MemoryClaims, root: Path, dev_root: Path
) -> None:
    bad = claims.add(
        claim_doc(
            name="bad",
            results=[("gpu", "gpu-0")],
            configs=[
                gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short", "speed": "fast"}})
            ],
        )
    )
    good = claims.add(claim_doc(name="good", results=[("gpu", "gpu-1")]))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        results = await node.plugin.prepare([bad, good])
        assert 'unknown field "sharing.timeSlicingConfig.speed"' in results[bad.uid].error
        assert "default/bad" in results[bad.uid].error
        assert results[bad.uid].devices == []
        assert results[good.uid].error == ""
        assert node.cdi_files() == [f"k8s.gpu.nvidia.com-claim_{good.uid}.json"]
        assert bad.uid not in node.service.checkpoint.claims


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (gpu_config({"strategy": "Spatial"}), "unknown GPU sharing strategy"),
        (
            gpu_config({"strategy": "TimeSlicing", "mpsConfig": {}}),
            "cannot use MpsConfig with the 'TimeSlicing' strategy",
        ),
        (gpu_config({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 150}}), "within 0..100"),
        (gpu_config(kind="MigDeviceConfig", requests=["gpu"]), "cannot apply MigDeviceConfig to request 'gpu'"),
        (
            gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": 3}}),
            'field "sharing.timeSlicingConfig.interval"',
        ),
        ({"source": "FromClaim", "requests": []}, "only opaque parameters are supported"),
    ],
)
async def test_invalid_configs_are_refused_with_a_reason(
    claims: MemoryClaims, root: Path, dev_root: Path, config: dict, message: str
) -> None:
    claim = claims.add(claim_doc(name="cfg", results=[("gpu", "gpu-0")], configs=[config]))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        result = (await node.plugin.prepare([claim]))[claim.uid]
        assert message in result.error
        assert node.cdi_files() == []


async def test_claim_allocated_to_another_node_is_refused(claims: MemoryClaims, root: Path, dev_root: Path) -> None:
    elsewhere = claims.add(claim_doc(name="far", node="n2", results=[("gpu", "gpu-0")]))
    foreign_pool = claims.add(claim_doc(name="pool", results=[("gpu", "gpu-0")], pool="n2"))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        results = await node.plugin.prepare([elsewhere, foreign_pool])
        assert "allocated to node(s) n2, not to this node n1" in results[elsewhere.uid].error
        assert "not this node's pool 'n1'" in results[foreign_pool.uid].error
        assert node.cdi_files() == []


async def test_devices_we_do_not_have_are_refused(claims: MemoryClaims, root: Path, dev_root: Path) -> None:
    missing = claims.add(claim_doc(name="ghost", results=[("gpu", "gpu-7")]))
    odd = claims.add(claim_doc(name="odd", results=[("gpu", "tpu-0")]))
    other_driver = claims.add(claim_doc(name="cd", results=[("ch", "channel-0")], driver="compute-domain.nvidia.com"))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        results = await node.plugin.prepare([missing, odd, other_driver])
        assert "device gpu-7 is unknown" in results[missing.uid].error
        assert "not a device this driver publishes" in results[odd.uid].error
        assert results[other_driver.uid].error == "" and results[other_driver.uid].devices == []


async def test_uid_mismatch_and_unallocated_claims_fail(claims: MemoryClaims, root: Path, dev_root: Path) -> None:
    doc = claim_doc(name="replaced", results=[("gpu", "gpu-0")])
    real = claims.add(doc)
    from embedded.kubelet.client import Claim

    stale = Claim(namespace="default", uid="00000000-0000-0000-0000-000000000000", name="replaced")
    unalloc_doc = claim_doc(name="pending", results=[])
    unalloc_doc["status"] = {}
    pending = claims.add(unalloc_doc)
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        results = await node.plugin.prepare([stale, pending])
        assert "got replaced" in results[stale.uid].error
        assert "not allocated" in results[pending.uid].error
        assert (await node.plugin.prepare([real]))[real.uid].error == ""


async def test_a_device_held_by_another_claim_is_refused(claims: MemoryClaims, root: Path, dev_root: Path) -> None:
    first = claims.add(claim_doc(name="first", results=[("gpu", "gpu-0")]))
    second = claims.add(claim_doc(name="second", results=[("gpu", "gpu-0")]))
    admin = claims.add(claim_doc(name="admin", results=[("gpu", "gpu-0")], admin=True))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        assert (await node.plugin.prepare([first]))[first.uid].error == ""
        refused = (await node.plugin.prepare([second]))[second.uid]
        assert "gpu-0 is already allocated to a different claim on this node" in refused.error
        assert first.uid not in refused.error and "default/first" not in refused.error  # the holder is not named
        assert (await node.plugin.prepare([admin]))[admin.uid].error == ""  # admin access is exempt
        await node.plugin.unprepare([first])
        assert (await node.plugin.prepare([second]))[second.uid].error == ""


async def test_a_spec_that_cannot_be_written_fails_the_prepare_and_the_checkpoint_never_says_prepared(
    claims: MemoryClaims, root: Path, dev_root: Path
) -> None:
    """The spec is written before the PrepareCompleted checkpoint write (which orders it: no directory fsync of
    its own): when it fails, that write does not happen, the claim is rolled back and a later prepare succeeds."""
    claim = claims.add(claim_doc(name="blocked", results=[("gpu", "gpu-0")]))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        cp_path = root / "plugins" / "gpu.nvidia.com" / "checkpoint.json"
        spec_file = node.cdi_dir / f"k8s.gpu.nvidia.com-claim_{claim.uid}.json"
        blocker = spec_file.with_name(f".{spec_file.name}.{os.getpid()}.tmp")  # the spec's temp file
        blocker.mkdir(parents=True)
        result = (await node.plugin.prepare([claim]))[claim.uid]
        assert "Is a directory" in result.error and str(blocker) in result.error, result.error
        assert json.loads(cp_path.read_text())["preparedClaims"] == {}
        assert not spec_file.exists()
        assert [e.event for e in node.service.events.pending] == ["prepare-started", "rolled-back", "prepare-failed"]
        blocker.rmdir()
        assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
        assert json.loads(cp_path.read_text())["preparedClaims"][claim.uid]["state"] == "PrepareCompleted"
        assert spec_file.exists()


async def test_a_prepare_and_unprepare_cost_no_fsync_with_a_boot_id_six_without(
    claims: MemoryClaims, root: Path, dev_root: Path
) -> None:
    """Where a power loss shows as a reboot (a boot id; checkpoint module doc) neither the checkpoint writes
    (PrepareCompleted, which also carries the staged PrepareStarted of a claim with nothing to undo, and the
    removal) nor the CDI spec fsync: only the boot marker did, at start; without a boot id, files and
    directories."""
    for boot_id, expected in (("boot-1", 0), ("", 6)):
        (root / "boot_id").write_text(boot_id)
        claim = claims.add(claim_doc(name=f"counted-{expected}", results=[("gpu", "gpu-0")]))
        async with running_node(claims, root, dev_root=str(dev_root)) as node:
            assert node.service.checkpoint.boot_id == boot_id
            before = fsync_count()
            assert (await node.plugin.prepare([claim]))[claim.uid].error == ""
            assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
            assert fsync_count() - before == expected


async def test_a_removed_spec_becomes_the_file_of_the_next_one_and_is_swept_at_start(
    claims: MemoryClaims, root: Path, dev_root: Path
) -> None:
    """With a boot id an unprepared claim's spec is renamed to a spare (a dot-named .tmp no CDI registry
    reads) and the next prepare's spec is written into it: the same file, no inode created or freed. A
    spare left when the preparer stops is swept at the next start."""
    first = claims.add(claim_doc(name="first", results=[("gpu", "gpu-0")]))
    second = claims.add(claim_doc(name="second", results=[("gpu", "gpu-1")]))
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        assert (await node.plugin.prepare([first]))[first.uid].error == ""
        spec = node.cdi_dir / f"k8s.gpu.nvidia.com-claim_{first.uid}.json"
        inode = spec.stat().st_ino
        assert await node.plugin.unprepare([first]) == {first.uid: ""}
        assert node.cdi_files() == []  # no *.json left: the spare is a dot-named .tmp
        (spare,) = [p for p in node.cdi_dir.iterdir() if p.name.endswith(".tmp")]
        assert spare.name.startswith(".k8s.gpu.nvidia.com-claim_") and spare.stat().st_ino == inode
        assert (await node.plugin.prepare([second]))[second.uid].error == ""
        reused = node.cdi_dir / f"k8s.gpu.nvidia.com-claim_{second.uid}.json"
        assert reused.stat().st_ino == inode and not spare.exists()
        assert json.loads(reused.read_text())["devices"][0]["name"] == f"{second.uid}-gpu-1"
        assert await node.plugin.unprepare([second]) == {second.uid: ""}
        assert [p.name for p in node.cdi_dir.iterdir()] != []
    async with running_node(claims, root, dev_root=str(dev_root)) as node:
        assert list(node.cdi_dir.iterdir()) == []
