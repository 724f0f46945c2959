"""Child processes that die with their parent, even when the parent is killed with SIGKILL.

`with_parent_death_signal(argv)` starts `argv` through a tiny launcher that sets Linux
PR_SET_PDEATHSIG and then execs `argv` (same pid), so the child gets the signal when the thread that
started it (the parent's event loop) ends, however it ends. A separate image rather than a
preexec_fn: code between fork and exec in a threaded parent can crash or deadlock the child.
"""

from __future__ import annotations

import os
import signal
import sys

_LAUNCHER = """
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]), 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[2]):
    sys.exit(1)  # the parent died before the prctl: nobody would signal us
try:
    os.execvp(sys.argv[3], sys.argv[3:])
except OSError as exc:
    sys.stderr.write(f"cannot start {sys.argv[3]}: {exc.strerror}\\n")
    sys.exit(127)
"""


def with_parent_death_signal(argv: list[str], sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """`argv` run so that it gets `sig` when the thread that starts it ends, even by SIGKILL (Linux
    PR_SET_PDEATHSIG, kept across exec); `argv` unchanged elsewhere."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(int(sig)), str(os.getpid()), *argv]
