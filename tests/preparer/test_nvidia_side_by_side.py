"""bench/nvidia_side_by_side.py's own parts, without NVIDIA's plugin or mock NVML (neither is in the repo)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.nvidia_side_by_side import DEFAULT_DRIVER_VERSION, lay_driver_root, mock_version, summary, tree_cpu_s


def test_mock_version_from_the_library_file_name(tmp_path: Path) -> None:
    lib = tmp_path / "libnvidia-ml.so.550.163.01"
    lib.write_bytes(b"\x7fELF")
    (tmp_path / "libnvidia-ml.so.1").symlink_to(lib.name)
    assert mock_version(lib) == "550.163.01"
    assert mock_version(tmp_path / "libnvidia-ml.so.1") == "550.163.01"  # the link resolved
    other = tmp_path / "libmock.so"
    other.write_bytes(b"")
    assert mock_version(other) == DEFAULT_DRIVER_VERSION


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_driver_root_has_the_mock_library_and_character_devices(tmp_path: Path) -> None:
    mock = tmp_path / "libnvidia-ml.so.550.163.01"
    mock.write_bytes(b"mock nvml")
    root = lay_driver_root(tmp_path / "driver", mock, "550.163.01")
    lib = root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    assert lib.resolve().read_bytes() == b"mock nvml"
    for name, minor in (("nvidia0", 0), ("nvidia7", 7), ("nvidiactl", 255)):
        st = (root / "dev" / name).stat()
        assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 195 and os.minor(st.st_rdev) == minor


def test_tree_cpu_counts_children() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "print('ok', flush=True)\ntime.sleep(30)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ok\n"
        own = time.process_time()
        assert tree_cpu_s(os.getpid()) >= own + 0.25 - 0.05  # its ticks, a little under the child's 0.3 s
    finally:
        child.kill()
        child.wait()


def _run(prepare: tuple[float, float], unprepare: tuple[float, float], rate: tuple[float, float]) -> dict:
    def plugin(p: float, u: float, r: float) -> dict:
        return {
            "cycles": 10,
            "prepare": {"p50_ms": p, "p95_ms": p},
            "unprepare": {"p50_ms": u},
            "preparer_cpu_ms_per_cycle": 1.0,
            "cpu_ms_per_cycle_with_children": 1.0,
            "batched": {"claims_per_s": r, "cpu_ms_per_claim": 1.0, "cpu_ms_per_claim_with_children": 1.0},
        }

    return {
        "ours": plugin(prepare[0], unprepare[0], rate[0]),
        "nvidia": plugin(prepare[1], unprepare[1], rate[1]),
        "rss_mb_end": {"ours": 1.0, "nvidia": 1.0},
        "ours_over_nvidia": {
            "prepare_p50": prepare[0] / prepare[1],
            "unprepare_p50": unprepare[0] / unprepare[1],
            "batch_claims_per_s": rate[0] / rate[1],
        },
    }


def test_summary_takes_medians_and_judges_goals_on_them() -> None:
    runs = [_run((1, 4), (1, 1.5), (600, 100)), _run((1, 2), (1, 2), (500, 100)), _run((3, 4), (1, 3), (800, 100))]
    out = summary(runs)
    assert out["runs"] == 3 and out["cycles_per_plugin"] == 30
    assert out["ours"]["prepare_p50_ms"] == 1 and out["nvidia"]["prepare_p50_ms"] == 4
    assert out["ours_over_nvidia"]["prepare_p50"] == 0.5
    assert out["ours_over_nvidia_range"]["batch_claims_per_s"] == [5.0, 8.0]
    assert out["goals_met"] == {
        "prepare_p50 <= 0.8x (issue 32)": True,
        "prepare_p50 <= 0.5x (issue 33)": True,
        "unprepare_p50 <= 0.5x (issue 33)": True,
        "batch_claims_per_s >= 5.0x (issue 33)": True,
    }
    slower = summary([_run((3, 4), (1, 1), (400, 100))])
    assert slower["goals_met"] == {
        "prepare_p50 <= 0.8x (issue 32)": True,
        "prepare_p50 <= 0.5x (issue 33)": False,
        "unprepare_p50 <= 0.5x (issue 33)": False,
        "batch_claims_per_s >= 5.0x (issue 33)": False,
    }
