"""The input fuzz suite (`tests/security/test_fuzz.py`) with many more examples per property.

The test suite runs 200 examples per property to stay under a minute; this runs N (default 5000)
with the same per-example deadline (1 s), and prints pytest's summary. Nothing is written.

    .venv/bin/python bench/fuzz_inputs.py [--examples 5000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=5000, help="examples per property (default 5000)")
    args = parser.parse_args()
    env = {**os.environ, "GPU_DRA_FUZZ_EXAMPLES": str(args.examples), "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--timeout",
        "0",
        "tests/security/test_fuzz.py",
    ]
    return subprocess.run(command, cwd=ROOT, env=env, check=False).returncode  # noqa: S603


if __name__ == "__main__":
    raise SystemExit(main())
