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
    write_spec(tmp_path / "claim_a.json", "k8s.gpu.nvidia.com/claim",
               [{"name": "a-gpu-0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}],
                                                       "env": ["NVIDIA_VISIBLE_DEVICES=void"]}},
                {"name": "a-gpu-1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}}],
               edits={"deviceNodes": [{"path": "/dev/nvidiactl"}], "env": ["A=1"]})
    write_spec(tmp_path / "mps.json", "k8s.gpu.nvidia.com/mps",
               [{"name": "d1", "containerEdits": {"mounts": [{"hostPath": "/h/pipe", "containerPath": "/p"}],
                                                  "env": ["A=2"]}}])
    (tmp_path / "notes.txt").write_text("ignored")
    (tmp_path / "broken.json").write_text("{")
    specs = load_specs([tmp_path])
    edits = resolve(["k8s.gpu.nvidia.com/claim=a-gpu-0", "k8s.gpu.nvidia.com/claim=a-gpu-1",
                     "k8s.gpu.nvidia.com/mps=d1"], specs)
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
