"""CDI id resolution as a runtime does it: spec edits once, device edits per id, unknown ids refused."""

from __future__ import annotations

import json

import pytest

from embedded.nodeagent.cdi_resolve import CdiResolutionError, load_specs, resolve


def write_spec(path, kind, devices, edits=None):
    spec = {"cdiVersion": "0.6.0", "kind": kind, "devices": devices}
    if edits:
        spec["containerEdits"] = edits
    path.write_text(json.dumps(spec))


def test_resolves_ids_across_specs(tmp_path):
    write_spec(
        tmp_path / "claim_a.json",
        "k8s.gpu.nvidia.com/claim",
        [
            {
                "name": "a-gpu-0",
                "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}], "env": ["NVIDIA_VISIBLE_DEVICES=void"]},
            },
            {"name": "a-gpu-1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}},
        ],
        edits={"deviceNodes": [{"path": "/dev/nvidiactl"}], "env": ["A=1"]},
    )
    write_spec(
        tmp_path / "mps.json",
        "k8s.gpu.nvidia.com/mps",
        [
            {
                "name": "d1",
                "containerEdits": {"mounts": [{"hostPath": "/h/pipe", "containerPath": "/p"}], "env": ["A=2"]},
            }
        ],
    )
    (tmp_path / "notes.txt").write_text("ignored")
    (tmp_path / "broken.json").write_text("{")
    specs = load_specs([tmp_path])
    edits = resolve(
        ["k8s.gpu.nvidia.com/claim=a-gpu-0", "k8s.gpu.nvidia.com/claim=a-gpu-1", "k8s.gpu.nvidia.com/mps=d1"], specs
    )
    assert edits.device_nodes == ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1"]
    assert edits.env == ["NVIDIA_VISIBLE_DEVICES=void", "A=2"], "later edits of a variable win"
    assert edits.mounts == ["/h/pipe:/p"]
    assert len(edits.cdi_devices) == 3


def test_unknown_or_malformed_ids_are_refused(tmp_path):
    write_spec(tmp_path / "c.json", "k8s.gpu.nvidia.com/claim", [{"name": "x", "containerEdits": {}}])
    specs = load_specs([tmp_path])
    with pytest.raises(CdiResolutionError, match="not found"):
        resolve(["k8s.gpu.nvidia.com/claim=y"], specs)
    with pytest.raises(CdiResolutionError, match="malformed"):
        resolve(["no-equals-sign"], specs)


def test_a_cache_reads_only_specs_that_changed(tmp_path):
    write_spec(tmp_path / "a.json", "k8s.gpu.nvidia.com/claim", [{"name": "a", "containerEdits": {"env": ["A=1"]}}])
    write_spec(tmp_path / "b.json", "k8s.gpu.nvidia.com/claim", [{"name": "b", "containerEdits": {"env": ["B=1"]}}])
    cache: dict = {}
    first = load_specs([tmp_path], cache)["k8s.gpu.nvidia.com/claim"]
    write_spec(tmp_path / ".b.tmp", "k8s.gpu.nvidia.com/claim", [{"name": "b", "containerEdits": {"env": ["B=2"]}}])
    (tmp_path / ".b.tmp").replace(tmp_path / "b.json")  # replaced as the preparer does: a new inode
    (tmp_path / "a.json").unlink()
    write_spec(tmp_path / "c.json", "k8s.gpu.nvidia.com/claim", [{"name": "c", "containerEdits": {}}])
    second = load_specs([tmp_path], cache)["k8s.gpu.nvidia.com/claim"]
    assert [s["devices"][0]["name"] for s in second] == ["b", "c"], "a removed spec is gone, a new one read"
    assert resolve(["k8s.gpu.nvidia.com/claim=b"], {"k8s.gpu.nvidia.com/claim": second}).env == ["B=2"]
    assert sorted(cache) == [str(tmp_path / "b.json"), str(tmp_path / "c.json")]
    third = load_specs([tmp_path], cache)["k8s.gpu.nvidia.com/claim"]
    assert all(x is y for x, y in zip(second, third, strict=True)), "unchanged specs are not read again"
    assert first[1] is not second[0]
