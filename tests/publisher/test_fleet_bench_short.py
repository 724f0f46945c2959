"""The fleet bench's short variant: real `gpu-dra publisher` replicas share a small fleet, one is SIGKILLed,
and the survivors write its changed nodes (bench/fleet_bench.py, which the full runs use at 10,000 and 65,000)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_three_replicas_publish_a_small_fleet_once_and_survive_a_kill(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    scratch = tmp_path / "tmp"  # the bench's own temp dir goes here, and must be gone after
    scratch.mkdir()
    subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "fleet_bench.py"),
            *("--nodes", "120", "--replicas", "3", "--changes", "5", "--kill", "--kill-sample", "10"),
            *("--timeout", "120", "--kill-timeout", "30", "--out", str(out)),
        ],
        check=True,
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(scratch)},
        capture_output=True,
        timeout=240,
    )
    got = json.loads(out.read_text())
    assert got["writes"] == 240  # each node's two slices, once
    assert got["nodes_written_by_several"] == 0 and got["conflicts"] == 0
    assert got["changes"] == 5
    assert got["changed_nodes"] == 10 and got["lost_writes"] == 0 and got["duplicate_writes"] == 0
    assert got["nodes_written_by_several_before_kill"] == 0 and got["same_hash_rewrites"] == 0
    assert list(scratch.iterdir()) == []  # its JetStream store, sim tree and kubeconfigs removed
