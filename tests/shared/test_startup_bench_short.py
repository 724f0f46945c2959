"""The start-up bench's short variant: one start of one command in this checkout and in a "compare" checkout (this
one again), the figures and their ratio written (bench/startup_bench.py; its full runs time every service and
`gpu-dra up`)."""

from __future__ import annotations

from pathlib import Path

from tests.benchrun import REPO, run_bench


def test_one_start_of_a_command_is_timed_in_both_checkouts(tmp_path: Path) -> None:
    got = run_bench(
        "startup_bench.py",
        tmp_path / "startup.json",
        *("--rounds", "1", "--commands", "apiserver", "--up-rounds", "0"),
        *("--compare-repo", str(REPO)),
    )
    this, other = got["this"]["start_cpu_ms"]["apiserver"], got["compare"]["start_cpu_ms"]["apiserver"]
    assert 0 < this < 10_000 and 0 < other < 10_000  # a start's own CPU, in ms
    assert got["ratio_this_over_compare"] == {"apiserver": round(this / other, 2)}
    assert "up_ready_s" not in got["this"]
