"""The ComputeDomain bench's short variant: two domains of four nodes whose nodes run in two processes of their own
(bench/computedomain_bench.py --node-processes; its full runs bring up 64 x 18)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_two_domains_in_node_processes_turn_ready_when_their_held_daemons_do(tmp_path: Path) -> None:
    out = tmp_path / "computedomain.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "computedomain_bench.py"),
            *("--nodes", "4", "--domains", "2", "--rounds", "1", "--daemon", "in-process", "--hold-last"),
            *("--node-processes", "2", "--out", str(out)),
        ],
        check=True,
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    got = json.loads(out.read_text())
    (only,) = got["rounds_detail"]
    assert got["node_processes"] == 2
    assert len(got["resources_at_end"]["node_processes_rss_mib"]) == 2
    # the held daemons turned Ready only once opened, and both domains after them
    assert only["opened_to_held_daemon_ready_ms"][0] >= 0
    assert only["opened_to_all_ready_ms"] >= only["opened_to_held_member_ready_seen_ms"][1]
    assert only["prepares_retried"] == 0
    # the node processes' own marks (prepare called, joined, prepared) reached the bench's timeline
    assert {"prepare_called", "joined", "daemon_ready", "prepared"} <= set(got["median_timeline_ms"])
