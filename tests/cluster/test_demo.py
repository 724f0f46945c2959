"""`gpu-dra demo` (what `make run` runs) completes the inventory pipeline and exits 0."""

from __future__ import annotations

import subprocess
import sys


def test_demo_publishes_slices_and_round_trips_a_taint():
    done = subprocess.run([sys.executable, "-m", "shared.cli", "pipeline-demo"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "gpu-7 " in out and "gpu-8-mig-3g20gb-9-0" in out, out
    assert "gpu.nvidia.com/xid" in out and "taint removed" in out
    assert "POST resourceslice" in out, "the waterfall shows the API write in the inventory trace"
