"""The ComputeDomain bench's short variant: two domains of four nodes whose nodes run in two processes of their own
(bench/computedomain_bench.py --node-processes; its full runs bring up 64 x 18)."""

from __future__ import annotations

from pathlib import Path

from tests.benchrun import run_bench


def test_two_domains_in_node_processes_turn_ready_when_their_held_daemons_do(tmp_path: Path) -> None:
    got = run_bench(
        "computedomain_bench.py",
        tmp_path / "computedomain.json",
        *("--nodes", "4", "--domains", "2", "--rounds", "1", "--daemon", "in-process", "--hold-last"),
        *("--node-processes", "2"),
    )
    (only,) = got["rounds_detail"]
    assert got["node_processes"] == 2
    assert len(got["resources_at_end"]["node_processes_rss_mib"]) == 2
    # the held daemons (in the node processes) turned Ready only once the bench opened the gate, and both domains
    # after the opening
    assert only["opened_to_held_daemon_ready_ms"][0] >= 0
    assert only["opened_to_all_ready_ms"] > 0
    # the node processes' own marks (prepare called, joined, prepared) reached the bench's timeline
    assert {"prepare_called", "joined", "daemon_ready", "prepared"} <= set(got["median_timeline_ms"])
