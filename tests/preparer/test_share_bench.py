"""bench/share_bench.py, short: a few cycles of each kind, through the same real parts (preparer sockets, discovery
on simulated H100s running the fake driver root's MPS binaries, nats-server). Its figures are the full run's to
give; here, what the bench asserts as it goes (every prepare and unprepare succeeds, one daemon all along) and what
a further share must not do: ask discovery to start the daemon."""

from __future__ import annotations

import pytest

from bench.share_bench import run


@pytest.mark.parametrize("own_limits", [False, True], ids=["residents-limits", "own-limits"])
async def test_the_share_bench_runs_short(own_limits: bool) -> None:
    result = await run(cycles=4, warmup=1, residents=2, own_limits=own_limits)
    for kind in ("share", "whole"):
        assert {phase: result[kind][phase]["n"] for phase in ("prepare", "unprepare")} == {"prepare": 4, "unprepare": 4}
    assert result["mps_start_requests_per_share_cycle"] == 0.0
    assert result["own_limits"] is own_limits and result["ratio_prepare_p50_share_over_whole"] > 0
