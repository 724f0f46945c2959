"""The API server's serving certificate without a data directory: made once per process in a private
directory that goes with the process (its key is left nowhere)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MAKE_AND_EXIT = """
import stat
from embedded.apiserver import tls
cert, key = tls.ensure_pair(None)
again = tls.ensure_pair(None)
assert again == (cert, key), again
assert key.read_bytes().startswith(b"-----BEGIN"), key
assert stat.S_IMODE(cert.parent.stat().st_mode) == 0o700, oct(cert.parent.stat().st_mode)
print(cert.parent)
"""


def test_a_process_without_a_data_dir_makes_one_private_pair_and_removes_it_at_exit() -> None:
    done = subprocess.run(
        [sys.executable, "-c", MAKE_AND_EXIT], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    directory = Path(done.stdout.strip())
    assert directory.name.startswith("gpu-dra-apiserver-tls-"), directory
    assert not directory.exists(), f"{directory} outlived its process: {sorted(p.name for p in directory.iterdir())}"
