"""The one way the tests run a bench script's short variant: `python bench/<script> <args> --out <file>` in its
own process, as a user runs it, and its figures read back from the results file it wrote. A run that fails is an
AssertionError carrying the end of its output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_bench(script: str, out: Path, *args: str, timeout: float = 120.0) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"bench/{script} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures
