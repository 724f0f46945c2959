"""The fleet page bench's short variant: 20 nodes, one run, headless chromium (bench/dashboard_bench.py; its full
runs load 1,000 nodes three times). It had stopped starting the page (the bench's NATS lacked the streams the page
reads) with nothing in the suite to say so."""

from __future__ import annotations

from pathlib import Path

from tests.benchrun import run_bench


def test_the_fleet_page_of_twenty_nodes_renders_and_shows_a_claim_written(tmp_path: Path) -> None:
    got = run_bench("dashboard_bench.py", tmp_path / "dashboard.json", "--nodes", "20", "--runs", "1", timeout=180)
    assert (got["nodes"], got["runs"]) == (20, 1) and got["claims"] > 0
    assert got["rows_in_dom"] > 0 and len(got["first_render_ms"]["all"]) == 1
    assert got["claim_write_to_tile_ms"] > 0  # the tile changed after the claim was written
    assert 0 < got["server_rss_mb"] <= got["server_peak_rss_mb"]
