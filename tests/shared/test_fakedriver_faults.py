"""The fake driver root's injected faults hit the calls they name and no other (tests/fakedriver.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from tests.fakedriver import make_driver_root


def run(root: Path, binary: str, *args: str, stdin: str = "", env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        [str(root / "usr" / "bin" / binary), *args], input=stdin, capture_output=True, text=True, timeout=30, env=env
    )


def test_fail_once_takes_the_first_call_with_the_argument_not_one_whose_path_holds_it(tmp_path: Path) -> None:
    # a temp root such as /tmp/gdp-a1b2c3 holds "-a": Fabric Manager's list names its socket under it
    fake = make_driver_root(tmp_path / "gdp-a1b2c3")
    socket = str(fake.root / "run" / "nvidia-fabricmanager" / "socket")
    fake.fail_once("nvidia-smi", "Failed to activate partition. fmReturn: -5", when="-a")
    listed = run(fake.root, "nvidia-smi", "-l", "--unix-domain-socket", socket)
    assert listed.returncode == 0, listed.stderr
    refused = run(fake.root, "nvidia-smi", "-a", "5", "--unix-domain-socket", socket)
    assert refused.returncode == 1 and "fmReturn: -5" in refused.stderr
    again = run(fake.root, "nvidia-smi", "-a", "5", "--unix-domain-socket", socket)
    assert again.returncode == 0, "the fault is used up"
    assert [c["argv"][:2] for c in fake.calls("nvidia-smi")] == [
        ["-l", "--unix-domain-socket"],
        ["-a", "5"],
        ["-a", "5"],
    ]


def test_fail_once_matches_a_command_read_from_stdin(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "root")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(tmp_path)}
    fake.fail_once("nvidia-cuda-mps-control", "Invalid value", when="set_default_active_thread_percentage")
    other = run(fake.root, "nvidia-cuda-mps-control", stdin="get_server_list\n", env=env)
    assert "Invalid value" not in other.stderr  # (no daemon runs: it fails for that)
    refused = run(fake.root, "nvidia-cuda-mps-control", stdin="set_default_active_thread_percentage 10\n", env=env)
    assert refused.returncode == 1 and "Invalid value" in refused.stderr
