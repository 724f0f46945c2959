"""Bench-only: what /proc says of a process, the one reader the benches share: CPU seconds it has used so far (user
+ system, 10 ms ticks), and its resident and peak resident memory."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int | str) -> float:
    """CPU seconds (user + system) process `pid` ("self": this one) has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def memory_mib(pid: int | str) -> tuple[float, float]:
    """(resident, peak resident) memory of process `pid` ("self": this one), MiB to one decimal."""
    got = {"VmRSS": 0, "VmHWM": 0}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in got:
            got[key] = int(value.split()[0])
    return round(got["VmRSS"] / 1024, 1), round(got["VmHWM"] / 1024, 1)
