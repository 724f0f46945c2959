"""No IMEX daemon outlives its agent: a record per running daemon, a parent-death signal, a sweep at start.

Owns three guards. `record`/`forget` keep `<domain-dir>/imexd.pid` (the daemon's pid and its kernel
start time, so a reused pid is never mistaken for our daemon). `with_parent_death_signal(argv)` (shared.parentdeath)
starts the daemon through a tiny launcher that sets Linux PR_SET_PDEATHSIG, so the daemon gets SIGTERM when
the agent dies, even by SIGKILL. `sweep(domains_dir)` runs at agent start, before any daemon is
started: every recorded daemon still alive is from a previous agent (this one has started none yet),
so it is ended (SIGTERM, SIGKILL after a grace) and its record removed; the daemon of a domain the
agent resumes is started afresh by the resume. Blocking (reads /proc, waits): call via to_thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from shared.logs import get_logger
from shared.parentdeath import with_parent_death_signal

log = get_logger(__name__)

__all__ = ["end", "forget", "record", "start_time", "sweep", "with_parent_death_signal"]

PID_FILE = "imexd.pid"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None when it is
    gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[19])


def record(path: Path, pid: int, command: str) -> None:
    """Write the record of a daemon just started."""
    data = {"pid": pid, "start_time": start_time(pid), "command": command}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def forget(path: Path) -> None:
    path.unlink(missing_ok=True)


def _alive(pid: int, started: int | None) -> bool:
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def end(pid: int, started: int | None, grace_s: float = 5.0) -> bool:
    """SIGTERM the process if it is still the one recorded, SIGKILL it after `grace_s`; True if it was."""
    if not _alive(pid, started):
        return False
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _alive(pid, started):
                return True
            time.sleep(0.02)  # not our child: no exit event to wait for
    return True


def sweep(domains_dir: Path, grace_s: float = 5.0) -> list[int]:
    """End every recorded daemon under `domains_dir/*/imexd.pid` that is still running; the pids ended."""
    ended: list[int] = []
    for path in sorted(domains_dir.glob(f"*/{PID_FILE}")):
        try:
            data = json.loads(path.read_text())
            pid, started = int(data["pid"]), data.get("start_time")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable IMEX daemon record; removing it", path=str(path), error=str(exc))
            forget(path)
            continue
        if end(pid, started, grace_s):
            log.warning(
                "ended an IMEX daemon a previous agent left running",
                pid=pid,
                record=str(path),
                command=data.get("command", ""),
            )
            ended.append(pid)
        forget(path)
    return ended
